# Sourced by tests/gpu/run.sh and tests/gpu/offload.sh: install .whl/*.whl and shardwise itself (built from this
# tree, with its `shardwise` command) into /tmp/site, offline, and put them first on PYTHONPATH and PATH; `out`
# is $OUT when set (the device tool's folder), else bench_out/gpu.
out="${OUT:-bench_out/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
site=/tmp/site

offline() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$@"; }
compgen -G ".whl/*.whl" >/dev/null || { echo "no .whl/: run tests/gpu/wheels.sh first, where PyPI is reachable"; exit 2; }
offline .whl/*.whl || { echo "installing .whl/*.whl failed (see above)"; exit 2; }
offline --no-build-isolation . || { echo "building shardwise from this tree failed (see above)"; exit 2; }
export PYTHONPATH="$site" PATH="$site/bin:$PATH"
{ date -u; nvidia-smi -L; python3 -m shardwise.cli env; } >"$out/env.txt" 2>&1

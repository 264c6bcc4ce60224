#!/usr/bin/env bash
# The GPU tier on a machine with a CUDA GPU and no network: `bash tests/gpu/run.sh` (after tests/gpu/wheels.sh
# filled .whl/ on a machine with PyPI). It
#   1. installs .whl/*.whl and shardwise itself (built from this tree, with its `shardwise` command) into
#      /tmp/site, offline;
#   2. runs `pytest -m cuda tests/gpu`, the whole tier (on one H200: 166 s for the 27 cases that are not
#      ZeRO-Offload's, 67 s for its 68, which tests/gpu/offload.sh runs alone);
#   3. runs `python -m benchmarks.cuda` at short settings (GPT 40m, 8 timed steps, every stage paired with its
#      peers; `--full-bench` adds each system alone in its own process: minutes more, and past the 150 s the
#      benchmark is given here, so run that one by hand).
# Logs, the benchmark's tables and summary.md go to $OUT when it is set (the device tool's folder), else
# bench_out/gpu. Exit status: 0 when both the tests and the benchmark's checks passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
isolation=pair
[[ "${1:-}" == "--full-bench" ]] && isolation=both
source tests/gpu/_install.sh

timeout 420 python3 -m pytest -m cuda tests/gpu -q -rA -p no:cacheprovider --junitxml="$out/gpu-tests.xml" 2>&1 \
    | tee "$out/gpu-tests.log"
tests=${PIPESTATUS[0]}
DS_ACCELERATOR=cuda timeout 150 python3 -m benchmarks.cuda --size 40m --micro-batch 8 --warmup 2 --steps 8 \
    --isolation "$isolation" --out "$out" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}

{
    echo "# GPU tier, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    grep -E '^(GPU [0-9]|packages|GPUs)' "$out/env.txt" | sed 's/^/    /'
    echo
    echo "pytest -m cuda tests/gpu (exit $tests): $(tail -n 1 "$out/gpu-tests.log")"
    grep -E '^(FAILED|ERROR) ' "$out/gpu-tests.log" | sed 's/^/    /'
    echo
    echo "python -m benchmarks.cuda (exit $bench):"
    echo
    cat "$out/cuda.md" 2>/dev/null || tail -n 5 "$out/bench.log"
} >"$out/summary.md"
cat "$out/summary.md"
exit $(( tests != 0 || bench != 0 ))

#!/usr/bin/env bash
# ZeRO-Offload's device check (issue 38) on a machine with one CUDA GPU and no network, in parts that each fit one
# device call of about 10 minutes (after tests/gpu/wheels.sh --deepspeed filled .whl/ where PyPI is reachable):
#   bash tests/gpu/offload.sh tests        the GPU tier's offload cases: `pytest -m "cuda and offload" tests/gpu`
#                                          (parity and checkpoints at every offload variant, tests/gpu/test_gpu_offload.py)
#   bash tests/gpu/offload.sh bench ARGS   `python -m benchmarks.offload --device cuda ARGS`, e.g.
#                                          `--part speed` (1.2B with and without offload, DeepSpeed's ZeRO-Offload
#                                          beside it when its wheel is installed), or `--part capacity --settings cpu
#                                          --layers 24,32` (one setting's sizes; each try is a process of its own)
# Installs as run.sh does; logs and summary.md go to $OUT when it is set, else bench_out/gpu.
set -uo pipefail
cd "$(dirname "$0")/../.."
part="${1:-tests}"
shift || true
source tests/gpu/_install.sh

if [[ "$part" == "tests" ]]; then
    timeout 540 python3 -m pytest -m "cuda and offload" tests/gpu -q -rA -p no:cacheprovider \
        --junitxml="$out/offload-tests.xml" 2>&1 | tee "$out/offload-tests.log"
    status=${PIPESTATUS[0]}
    summary="pytest -m \"cuda and offload\" tests/gpu (exit $status): $(tail -n 1 "$out/offload-tests.log")"
else
    DS_ACCELERATOR=cuda timeout 560 python3 -m benchmarks.offload --device cuda --out "$out" "$@" 2>&1 \
        | tee "$out/offload-bench.log"
    status=${PIPESTATUS[0]}
    summary="python -m benchmarks.offload --device cuda $* (exit $status)"
fi
{
    echo "# ZeRO-Offload on the device, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    grep -E '^(GPU [0-9]|packages|GPUs)' "$out/env.txt" | sed 's/^/    /'
    echo
    echo "$summary"
    grep -E '^(FAILED|ERROR) ' "$out/offload-tests.log" 2>/dev/null | sed 's/^/    /'
    grep -E '^(\||device|pinned|speed)' "$out/offload-bench.log" 2>/dev/null
} >"$out/summary.md"
cat "$out/summary.md"
exit "$status"

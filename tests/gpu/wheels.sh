#!/usr/bin/env bash
# Fetch, on a machine that reaches PyPI, the wheels the GPU machine's image lacks, into .whl/ (git-ignored);
# tests/gpu/run.sh installs them there, offline. Run from anywhere in the repo: `bash tests/gpu/wheels.sh`.
#
# The image (Python 3.12, torch 2.11 with CUDA) has, as its package list says: PyYAML, safetensors, numpy,
# tqdm, matplotlib, pytest, pytest-timeout, transformers, lightning, setuptools and wheel (what shardwise,
# its tests and an offline build of it need). It lacks pydantic with what it pins (pydantic-core,
# annotated-types, typing-inspection), hjson and xxhash (the NVMe offload's digests); typing-extensions comes too, since pydantic needs a recent
# one and the image's version is not listed. With --deepspeed it also builds DeepSpeed (pure Python, its
# CUDA ops compiled on first use, which the benchmark's torch optimizer never needs) for benchmarks.cuda's
# DeepSpeed peer; the rest of what DeepSpeed needs (msgpack, ninja, psutil, py-cpuinfo, einops) is in the image.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYDANTIC=2.13.4         # the version the suite runs with here
DEEPSPEED=0.19.8        # the version docs/benchmarks.md measured
python=${PYTHON:-python3}

rm -rf .whl && mkdir .whl  # one version of each: two would stop the install on the device
download() {
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$@"
}
download "pydantic==$PYDANTIC"
# pydantic pins its core exactly: read the pin from the wheel rather than keeping a second number here
core=$(unzip -p .whl/pydantic-"$PYDANTIC"-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
download "pydantic-core==$core" annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.15.0 hjson==3.1.0 \
    xxhash==4.1.0
if [[ "${1:-}" == "--deepspeed" ]]; then
    # DeepSpeed publishes a source archive only: build its pure-Python wheel (no ops) with the torch here
    DS_BUILD_OPS=0 "$python" -m pip wheel --quiet --no-deps --no-build-isolation -w .whl "deepspeed==$DEEPSPEED"
fi
ls -1 .whl

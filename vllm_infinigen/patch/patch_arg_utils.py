# SPDX-License-Identifier: Apache-2.0
"""Patch of ``vllm.engine.arg_utils``: InfiniGen's flags, keywords and engine set-up.

The wrappers only route: the flags and keywords come from
``frontend/args.py``, the refusals from ``frontend/checks.py``, the skew file
from ``frontend/skew_setup.py``. With ``--kv-manager vllm`` (the default)
each falls through to ``_original_<fn>`` with the arguments unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.logger import init_logger

from vllm_infinigen.config import infinigen_config_of
from vllm_infinigen.engine_setup import engine_setup
from vllm_infinigen.frontend.args import (
    add_infinigen_args,
    extras_from_cli,
    fold_into_additional_config,
    split_kwargs,
)
from vllm_infinigen.frontend.checks import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    attention_plan,
    check_engine_args,
    keep_v1_model_runner,
    layout_of,
    model_hf_config,
)
from vllm_infinigen.frontend.skew_setup import prepare_skew_file
from vllm_infinigen.memory import cap_rows
from vllm_infinigen.platforms import platform_name, worker_cls_for
from vllm_infinigen.skewing.tables import model_files

logger = init_logger(__name__)

_original_init: dict[type, Any] = {}
_original_add_cli_args = None
_original_from_cli_args = None
_original_create_engine_config = None


def _make_init(cls: type):
    original = cls.__dict__["__init__"]
    _original_init[cls] = original

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        extras = split_kwargs(kwargs)
        original(self, *args, **kwargs)
        if extras:
            self.additional_config = fold_into_additional_config(
                self.additional_config, extras
            )

    return __init__


def _add_cli_args(parser):
    return add_infinigen_args(_original_add_cli_args(parser))


def _from_cli_args(cls, args: argparse.Namespace):
    engine_args = _original_from_cli_args.__func__(cls, args)
    folded = fold_into_additional_config(engine_args.additional_config, extras_from_cli(args))
    if folded != engine_args.additional_config:
        # Back into the arguments too: vLLM hands them to the processes it spawns
        # (``--api-server-count``, data parallelism), which parse them before they
        # load this plugin; they then read the settings from --additional-config.
        args.additional_config = folded
    engine_args.additional_config = folded
    return engine_args


def _create_engine_config(self, *args, **kwargs):
    config = infinigen_config_of(self.additional_config)
    if config is None:
        return _original_create_engine_config(self, *args, **kwargs)
    from vllm.platforms import current_platform

    model_config = self.create_model_config()  # the model stock vLLM will load
    hf_config = model_hf_config(model_config)
    attention = attention_plan(model_config, hf_config)
    layout = layout_of(hf_config, config, attention)
    check_engine_args(self, config, hf_config, attention, layout)
    if attention is not None and attention.switches_window_off:
        logger.info(
            "InfiniGen: the sliding window of %d tokens is at least --max-model-len %d, "
            "so it never excludes a token: running its layers as full attention "
            "(--disable-sliding-window)", attention.window, attention.max_model_len)
        self.disable_sliding_window = True
    if config.speculation_keys == "partial":  # the int keys need no skew
        model_dir = model_files(model_config.model, model_config.revision, self.download_dir)
        config = dataclasses.replace(config,
                                     skew_file=prepare_skew_file(model_dir, config, layout))
    self.additional_config = {**self.additional_config, "infinigen": config.to_dict()}
    from vllm.config import KVTransferConfig

    if self.enable_prefix_caching is None:  # vLLM's default: on where it can run
        reason = config.prefix_caching_refusal()
        if reason is not None:
            logger.info("InfiniGen: prefix caching off (vLLM's default is on): %s", reason)
            self.enable_prefix_caching = False
    self.worker_cls = worker_cls_for(platform_name(current_platform))
    # A producer: InfiniGen loads nothing into vLLM's blocks out of stream order (the
    # residency's copies from the pool synchronize first, worker/restore.py), so vLLM
    # need not hold freed blocks a step longer under async scheduling, its CUDA
    # default (v1/core/sched/scheduler.py: "defer_block_free" for consumers).
    self.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_producer",
    )
    vllm_config = _original_create_engine_config(self, *args, **kwargs)
    keep_v1_model_runner(vllm_config)
    if vllm_config.speculative_config is not None:
        raise ValueError(
            "--kv-manager infinigen does not support speculative decoding; "
            "remove --speculative-config"
        )
    setup = engine_setup(vllm_config, parsed=config, layout=layout)
    # A cap too small for one step fails here, naming the flags.
    cap_rows(setup.config.cpu_pool_gib, setup.pool_bytes_per_token, setup.step_tokens)
    return vllm_config


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

# SPDX-License-Identifier: Apache-2.0
"""Every process: what each InfiniGen part of one engine reads, the settings
(``config.py``) and the model's layout, derived once per process from vLLM's config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm_infinigen.architectures import AttentionPlan
from vllm_infinigen.config import InfiniGenConfig, infinigen_config_of
from vllm_infinigen.layout import ModelLayout, kv_dtype


@dataclass(frozen=True)
class EngineSetup:
    """What every InfiniGen part of one engine reads: the settings and the
    model's layout, derived once per process from vLLM's config."""

    config: InfiniGenConfig
    layout: ModelLayout
    dtype_bytes: int  # of the model's dtype (the speculation keys)
    step_tokens: int  # tokens one step writes at most (--max-num-batched-tokens)
    # Of a cached K/V element (vLLM's pages, the pool): the model's dtype, 1 in FP8.
    kv_dtype_bytes: int
    # KV heads summed over the tensor-parallel ranks: the model's, or the ranks'
    # count where there are fewer (vLLM replicates a head on several ranks).
    kv_heads_all_ranks: int

    @property
    def pool_bytes_per_token(self) -> int:
        """K/V bytes of every sparse layer for one token, all ranks (a replicated
        head's on each rank that holds it)."""
        return self.layout.pool_bytes_per_token(self.kv_dtype_bytes, self.kv_heads_all_ranks)


# id(additional_config) -> (that dict, its setup): one parse per process and
# config; the dict is kept so that its id cannot be reused.
_setups: dict[int, tuple[dict, EngineSetup]] = {}


def engine_setup(vllm_config, parsed: InfiniGenConfig | None = None,
                 layout: ModelLayout | None = None) -> EngineSetup | None:
    """The engine's ``EngineSetup`` (None when InfiniGen is off), parsed once.

    Args:
        parsed: The settings, already parsed from this ``additional_config``
            by the caller (the front end, which validates them first).
        layout: The model's layout with these settings, already built by the
            caller (the front end); its head size is taken from vLLM's model.
    """
    additional = vllm_config.additional_config
    cached = _setups.get(id(additional))
    if cached is not None and cached[0] is additional:
        return cached[1]
    config = parsed if parsed is not None else infinigen_config_of(additional)
    if config is None:
        return None
    model = vllm_config.model_config
    if layout is None:
        layout = ModelLayout.from_hf_config(
            model.hf_text_config, config.dense_layers, config.partial_ratio,
            window_layers=AttentionPlan.of(model).window_layers,
            speculation_keys=config.speculation_keys)
    layout = dataclasses.replace(layout, head_dim=model.get_head_size())
    ranks = vllm_config.parallel_config.tensor_parallel_size
    setup = EngineSetup(config, layout, model.dtype.itemsize,
                        vllm_config.scheduler_config.max_num_batched_tokens,
                        kv_dtype(vllm_config.cache_config.cache_dtype, model.dtype).itemsize,
                        ranks * max(1, layout.num_kv_heads // ranks))
    _setups[id(additional)] = (additional, setup)
    return setup

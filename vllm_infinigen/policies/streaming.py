# SPDX-License-Identifier: Apache-2.0
"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention
Sinks", ICLR 2024) as a selection policy: the first 4 tokens (attention sinks)
and the most recent ones, ``floor(budget x context)`` in all (at least 1; the
current token is attended on top), the same for every KV head. No state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_infinigen.policies.base import (
    Selection,
    SelectionPolicy,
    as_positions,
    from_position_mask,
)
from vllm_infinigen.block_layout import widest

if TYPE_CHECKING:
    from vllm_infinigen.config import InfiniGenConfig
    from vllm_infinigen.worker.layer_state import LayerState
    from vllm_infinigen.worker.step_plan import StepPlan

STREAMING_SINK_TOKENS = 4


def streaming_select(context_lens: torch.Tensor, token_caps: torch.Tensor, num_heads: int,
                     num_tokens: int, width: int) -> Selection:
    """Sinks and the most recent tokens: [B] context lengths and budgets in
    tokens (``step_plan.token_budget``) -> [B, H_kv, width]."""
    caps = token_caps[:, None]  # [B, 1]
    lens = context_lens.to(torch.int64)[:, None]
    sinks = torch.clamp(caps, max=STREAMING_SINK_TOKENS)
    positions = torch.arange(num_tokens, device=context_lens.device)[None]
    chosen = (positions < sinks) | (positions >= lens - (caps - sinks))
    chosen &= positions < lens
    return from_position_mask(chosen[:, None].expand(-1, num_heads, -1), width)


class StreamingPolicy(SelectionPolicy):
    name = "streaming"

    def select(self, layer: LayerState, plan: StepPlan, query: torch.Tensor,
               settings: InfiniGenConfig, row_map: torch.Tensor | None) -> torch.Tensor:
        rows = plan.sparse_rows
        selection = streaming_select(
            rows.context_lens, rows.token_caps, layer.num_kv_heads,
            max(plan.context_host, default=1), widest(rows.context_host, rows.caps_host))
        return as_positions(selection)

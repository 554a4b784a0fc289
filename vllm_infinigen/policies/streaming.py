# SPDX-License-Identifier: Apache-2.0
"""StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention
Sinks", ICLR 2024) as a selection policy: the first 4 tokens (attention sinks)
and the most recent ones, ``floor(budget x context)`` in all (at least 1; the
current token is attended on top), the same for every KV head. No state.
"""

from __future__ import annotations

import torch

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layer_state import LayerState
from vllm_infinigen.policies.base import (
    SelectionPolicy,
    as_positions,
    context_slots,
    from_position_mask,
)
from vllm_infinigen.selector import Selection, max_selected, token_caps
from vllm_infinigen.step_plan import StepPlan

STREAMING_SINK_TOKENS = 4


def streaming_select(context_lens: torch.Tensor, budget: float, num_heads: int,
                     num_tokens: int, width: int) -> Selection:
    """Sinks and the most recent tokens: [B] context lengths -> [B, H_kv, width]."""
    caps = token_caps(context_lens, budget)[:, None]  # [B, 1]
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
        _, context_lens, context_host = context_slots(plan, with_slots=False)
        selection = streaming_select(
            context_lens, settings.budget, layer.num_kv_heads,
            max(plan.context_host, default=1), max_selected(context_host, settings.budget, 0))
        return as_positions(selection)

# SPDX-License-Identifier: Apache-2.0
"""The interface every selection policy implements, and helpers they share.

The runtime (``worker/runtime.py``) calls a policy at fixed points of a step::

    allocate(layer)             once a sparse layer's pool exists (and when the
                                policy is switched on in a running engine)
    on_write(layer, key, slots) after new K/V reach the pool
    select(layer, plan, query)  in the layer's own attention, before it
                                attends (policies that select in the layer)
    select_ahead(source, plan)  in the layer before, for ``source.next``
                                (when ``selects_ahead``: InfiniGen's default)
    on_attend(layer, plan, positions, probs)
                                after the attention, with the attention each
                                selected token received (``records_attention``)
    attend_prompt(...)          the prompt rows, when the policy scores them

A selection is [S, H_kv, W] int32 ascending token positions per KV head of
each sparse row, -1 padded (W: the step's widest selection, host side).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from vllm_infinigen.config import InfiniGenConfig
    from vllm_infinigen.worker.layer_state import LayerState
    from vllm_infinigen.worker.step_plan import StepPlan


@dataclass
class Selection:
    """Tokens that a sparse layer attends to, for the selecting rows of a step.

    ``positions[b, h, j]`` is a token position in row b's context, valid where
    ``valid[b, h, j]``; the valid entries come first.
    """

    positions: torch.Tensor  # [B, H_kv, K] int64
    valid: torch.Tensor  # [B, H_kv, K] bool
    num_selected: torch.Tensor  # [B] int64


class SelectionPolicy:
    """One selection rule with the per-slot state it keeps (per sparse layer).

    Its traits that the settings check (capped pool, evaluation mode) are in
    the registry's table (``policies/__init__.py``).
    """

    name: ClassVar[str]
    # Wants the attention each selected token received (``on_attend``).
    records_attention: ClassVar[bool] = False

    def selects_ahead(self, settings: InfiniGenConfig) -> bool:
        """Selects for the next layer from this layer's attention input (prefetch)."""
        return False

    def allocate(self, layer: LayerState) -> None:
        """Per-slot state of a sparse layer whose pool exists (may read the pool)."""

    def on_write(self, layer: LayerState, key: torch.Tensor, slots: torch.Tensor) -> None:
        """New keys [T, H_kv, D] of ``slots`` [T] int64 (< 0: padding) are in the pool."""

    def select(self, layer: LayerState, plan: StepPlan, query: torch.Tensor,
               settings: InfiniGenConfig, row_map: torch.Tensor | None) -> torch.Tensor:
        """The selection of ``layer``'s sparse rows; query: [T, H_q, D] of the layer.

        Args:
            row_map: The capped pool's rows of ``layer`` (None: uncapped).
        """
        raise NotImplementedError(f"policy {self.name} selects ahead, not in the layer")

    def select_ahead(self, source: LayerState, plan: StepPlan, settings: InfiniGenConfig,
                     row_map: torch.Tensor | None) -> torch.Tensor:
        """The selection of ``source.next``'s sparse rows, from ``source``'s input.

        Args:
            row_map: The capped pool's rows of ``source.next`` (None: uncapped).
        """
        raise NotImplementedError(f"policy {self.name} selects in the layer")

    def on_attend(self, layer: LayerState, plan: StepPlan, positions: torch.Tensor,
                  probs: torch.Tensor) -> None:
        """Attention each selected token received: positions, probs [S, H_kv, W]."""

    def attend_prompt(self, layer: LayerState, plan: StepPlan, query: torch.Tensor,
                      output: torch.Tensor, row_map: torch.Tensor | None) -> bool:
        """Attends the prompt rows itself (True) or leaves them to the kernel (False)."""
        return False


class UsedPolicies:
    """Every policy an engine has used, by name. Each keeps its per-slot state
    current from its first use on (``allocate``, then ``on_write`` at every
    write), so that a switch back at run time finds it whole.

    Args:
        make: The policy registered under a name (``policies.policy_class``).
    """

    def __init__(self, make: Callable[[str], type[SelectionPolicy]]) -> None:
        self._make = make
        self._by_name: dict[str, SelectionPolicy] = {}
        self._layers: list[LayerState] = []  # sparse layers whose pool exists
        self.keep_write_state = False  # some policy has per-slot state of the writes

    def get(self, name: str) -> SelectionPolicy:
        """The policy ``name``, allocated on every layer with a pool on first use."""
        if name not in self._by_name:
            policy = self._make(name)()
            for layer in self._layers:
                policy.allocate(layer)
            self._by_name[name] = policy
            self.keep_write_state |= type(policy).on_write is not SelectionPolicy.on_write
        return self._by_name[name]

    def allocate(self, layers: list[LayerState]) -> None:
        """The sparse layers' pools now exist: every policy so far allocates on them."""
        self._layers = list(layers)
        for policy in self._by_name.values():
            for layer in self._layers:
                policy.allocate(layer)

    def on_write(self, layer: LayerState, key: torch.Tensor, slots: torch.Tensor) -> None:
        """New keys of ``slots`` are in ``layer``'s pool (``SelectionPolicy.on_write``)."""
        if self.keep_write_state:
            for policy in self._by_name.values():
                policy.on_write(layer, key, slots)


def from_position_mask(chosen: torch.Tensor, width: int) -> Selection:
    """A selection of ``width`` entries from a mask over positions [B, H_kv, N] bool."""
    num_tokens = chosen.shape[-1]
    width = max(1, min(width, num_tokens))
    # Chosen positions first (in position order), then padding.
    order = chosen.to(torch.int64) * (2 * num_tokens) - torch.arange(num_tokens,
                                                                      device=chosen.device)
    top = torch.topk(order, width, dim=-1).indices
    valid = torch.gather(chosen, -1, top)
    return Selection(positions=top, valid=valid, num_selected=valid[:, 0].sum(dim=-1))


def as_positions(selection: Selection) -> torch.Tensor:
    """[B, H_kv, W] int32 ascending positions, -1 padded, of a ``Selection``."""
    positions = selection.positions.masked_fill(~selection.valid, -1)
    order = torch.where(positions < 0, torch.iinfo(torch.int64).max, positions)
    return positions.gather(-1, order.argsort(dim=-1)).to(torch.int32).contiguous()


def sparse_slots(plan: StepPlan) -> torch.Tensor:
    """[S, N] slot id of every context position of the step's sparse rows
    (``plan.sparse_rows``, N the longest): what addresses a policy's per-slot
    state."""
    return plan.context_slots[plan.sparse]

# SPDX-License-Identifier: Apache-2.0
"""Worker side: the rows of one step that attend over a selection, computed once per step.

vLLM's metadata lists, per request, its query rows (``query_start_loc``) and
its length after the step (``seq_lens``). InfiniGen sorts the rows into:

    selecting rows  one per decode request (a sampled token past the prompt)
                    and, in evaluation mode, each prompt row past the dense
                    prefix; each attends over its context's selection, or
                    densely when its context is shorter than ``min_context``
    prompt rows     every row of a request still in its prompt: causal
                    attention over the pool, as vLLM would

A data path that plans on the device (``DataPath.plans_on_device``: CUDA)
gets a step whose rows all decode one token (vLLM's uniform decode batch,
what a full CUDA graph captures) planned without a host read
(``build_device_plan``): every row selects, its bounds static, its context
only on the device (a padding row of a captured batch has context -1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_infinigen.block_layout import block_coordinates

if TYPE_CHECKING:
    from vllm_infinigen.config import InfiniGenConfig


def token_budget(context_lens: torch.Tensor, budget: float,
                 budget_tokens: int | None = None) -> torch.Tensor:
    """The budget in tokens of each row: min(floor(budget x context),
    ``budget_tokens``), at least 1.

    The one definition of ``--infinigen-budget`` and ``--infinigen-budget-tokens``
    in tokens: the selection kernels and every policy take its result (a
    platform that selects on the device computes the same there:
    ``platforms/cuda/kernels.select``).

    Args:
        context_lens: [B] tokens in each row's context (its own token excluded).
        budget_tokens: The cap in tokens, or None.
    """
    caps = torch.floor(context_lens.to(torch.float64) * budget).to(torch.int64)
    if budget_tokens is not None:
        caps = torch.clamp(caps, max=budget_tokens)
    return torch.clamp(caps, min=1)


@dataclass(frozen=True)
class RowSet:
    """Some of a step's selecting rows, gathered once per step for every layer.

    ``tokens`` is a slice where the rows are the step's first n rows in order
    (always in a step planned on the device, whose host copies and budget are
    None: the platform's selection computes the budget on the device).
    """

    tokens: torch.Tensor | slice  # [n] rows in the step's query tensor
    context_lens: torch.Tensor  # [n] int64
    block_table: torch.Tensor  # [n, max_blocks] int32, contiguous
    token_caps: torch.Tensor | None  # [n] int64 the budget in tokens (``token_budget``)
    caps_host: list[int] | None  # host copy of token_caps
    context_host: list[int] | None  # host copy of context_lens
    # [n] int64 the rows' own positions (RoPE), where they differ from
    # context_lens (a padding row: context -1, position 0); None: context_lens.
    positions: torch.Tensor | None = None

    @property
    def rope_positions(self) -> torch.Tensor:
        """[n] int64 the position of each row's own token."""
        return self.context_lens if self.positions is None else self.positions

    @property
    def size(self) -> int:
        return self.context_lens.shape[0]


@dataclass
class StepPlan:
    """The selecting rows of one step and the prompt rows beside them."""

    rows: torch.Tensor  # [B] request index of each selecting row
    tokens: torch.Tensor  # [B] row in the step's query tensor
    context_lens: torch.Tensor  # [B] int64 tokens before each row
    context_host: list[int]  # host copy of context_lens
    token_caps: torch.Tensor  # [B] int64 the budget in tokens (``token_budget``)
    caps_host: list[int]  # host copy of token_caps
    block_table: torch.Tensor  # [B, max_blocks] int32 dense-group block ids
    sparse: torch.Tensor  # [S] indices into the B rows that attend over a selection
    dense: torch.Tensor  # [B - S] indices of the rows that attend densely (short context)
    prompt_requests: torch.Tensor  # [P] int64 requests with prompt rows
    query_start: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64
    all_block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    block_size: int
    on_device: bool = False  # ``build_device_plan``: every row selects, nothing on the host

    @property
    def has_other_rows(self) -> bool:
        """Prompt (or chunked-prompt) rows are present."""
        return self.prompt_requests.numel() > 0

    @property
    def num_decodes(self) -> int:
        return self.rows.shape[0]

    @functools.cached_property
    def short_decode_only(self) -> bool:
        """Every row of the step is a decode row below ``min_context``: none
        selects, no prompt rows (nothing speculates or captures)."""
        return not self.selects and not self.has_other_rows

    @property
    def selects(self) -> bool:
        """Some row attends over a selection (known on the host)."""
        return self.on_device or bool(self.sparse.numel())

    @functools.cached_property
    def sparse_rows(self) -> RowSet:
        """The rows that attend over a selection."""
        if self.on_device:
            return RowSet(self.tokens, self.context_lens, self.block_table, None, None, None,
                          positions=self.context_lens.clamp(min=0))
        return self._subset(self.sparse)

    @functools.cached_property
    def dense_rows(self) -> RowSet:
        """The rows that attend densely (context shorter than ``min_context``)."""
        if self.on_device:  # the platform's selection keeps every block of such a row
            return RowSet(slice(0, 0), self.context_lens[:0], self.block_table[:0], None, None,
                          None)
        return self._subset(self.dense)

    def _subset(self, index: torch.Tensor) -> RowSet:
        rows = index.tolist()
        tokens = self.tokens[index]
        if tokens.tolist() == list(range(len(rows))):
            # The step's first rows in order (every row of a decode-only step):
            # a slice, so that each layer's query[tokens] is a view and its
            # output[tokens] = ... a copy, not a gather and a scatter (each
            # ~25-50 us per layer on the CPU).
            tokens = slice(0, len(rows))
        return RowSet(tokens=tokens,
                      context_lens=self.context_lens[index].contiguous(),
                      block_table=self.block_table[index].contiguous(),
                      token_caps=self.token_caps[index].contiguous(),
                      caps_host=[self.caps_host[i] for i in rows],
                      context_host=[self.context_host[i] for i in rows])

    @functools.cached_property
    def context_slots(self) -> torch.Tensor:
        """[B, N] slot id of every context position (for the policies' per-slot state)."""
        width = max(self.context_host, default=1)
        positions = torch.arange(width, device=self.block_table.device).expand(
            self.num_decodes, width)
        block_ids, offsets = block_coordinates(positions, self.block_table, self.block_size)
        return block_ids * self.block_size + offsets


def build_device_plan(attn_metadata, block_size: int) -> StepPlan:
    """A uniform decode step planned without a host read (``plans_on_device``).

    Every row of the metadata decodes one token and selects (``min_context``
    is the platform's: its selection keeps every block of a shorter row);
    shapes come from the metadata's tensors alone, so a captured graph's
    padded batch plans alike (its padding rows: context -1).
    """
    seq_lens = attn_metadata.seq_lens
    num_rows = seq_lens.shape[0]
    every = slice(0, num_rows)
    context_lens = seq_lens.to(torch.int64) - 1
    none = torch.empty(0, dtype=torch.int64, device=seq_lens.device)
    block_table = attn_metadata.block_table[:num_rows]
    return StepPlan(rows=torch.arange(num_rows, device=seq_lens.device), tokens=every,
                    context_lens=context_lens, context_host=None, token_caps=None,
                    caps_host=None, block_table=block_table, sparse=none, dense=none,
                    prompt_requests=none, query_start=attn_metadata.query_start_loc,
                    seq_lens=seq_lens, all_block_table=block_table, block_size=block_size,
                    on_device=True)


def build_plan(attn_metadata, config: InfiniGenConfig, block_size: int,
               prompt_lens_of: Callable[[int], torch.Tensor] | None, *,
               on_device: bool = False) -> StepPlan:
    """The step's plan from the dense group's metadata.

    Args:
        prompt_lens_of: num_reqs -> [num_reqs] prompt length of each request
            in the metadata's order (None: a one-row request with context is
            a decode row).
        on_device: The data path plans decode steps on the device: a step
            whose rows all carry one token (``max_query_len`` 1) outside
            evaluation mode gets ``build_device_plan``.
    """
    if (on_device and getattr(attn_metadata, "max_query_len", None) == 1
            and config.eval_dense_prefix is None):
        return build_device_plan(attn_metadata, block_size)
    query_start = attn_metadata.query_start_loc.cpu().to(torch.int64)
    seq_lens = attn_metadata.seq_lens.cpu().to(torch.int64)
    num_reqs = seq_lens.shape[0]
    query_start = query_start[: num_reqs + 1]
    query_lens = query_start[1:] - query_start[:-1]
    # A decode row computes a sampled token: past the prompt. (vLLM's own
    # split counts a one-token prompt chunk as a decode; it is a prompt row.)
    prompt_lens = (torch.ones_like(seq_lens) if prompt_lens_of is None
                   else prompt_lens_of(num_reqs).to(seq_lens.dtype))
    is_decode = (query_lens == 1) & (seq_lens > prompt_lens)
    rows = torch.nonzero(is_decode).flatten()
    tokens = query_start[rows]
    context_lens = seq_lens[rows] - 1
    prefix = config.eval_dense_prefix
    if prefix is not None and not bool(is_decode.all()):
        rows, tokens, context_lens = _with_prompt_rows(
            ~is_decode, query_start, seq_lens, max(prefix, 1))
    all_block_table = attn_metadata.block_table[:num_reqs]
    short = context_lens < config.min_context
    token_caps = token_budget(context_lens, config.budget, config.budget_tokens)
    return StepPlan(
        rows=rows,
        tokens=tokens,
        context_lens=context_lens.contiguous(),
        context_host=context_lens.tolist(),
        token_caps=token_caps,
        caps_host=token_caps.tolist(),
        block_table=all_block_table[rows].contiguous(),
        sparse=torch.nonzero(~short).flatten(),
        dense=torch.nonzero(short).flatten(),
        prompt_requests=torch.nonzero(~is_decode).flatten(),
        query_start=query_start.contiguous(),
        seq_lens=seq_lens.contiguous(),
        all_block_table=all_block_table,
        block_size=block_size,
    )


def _with_prompt_rows(is_prompt: torch.Tensor, query_start: torch.Tensor,
                      seq_lens: torch.Tensor, prefix: int):
    """Decode rows plus, per prompt request, its rows at positions >= ``prefix``.

    Returns (request index, token index in the batch, context length) of every
    row attending over a selection, in token order (host tensors).
    """
    rows, tokens, contexts = [], [], []
    for request in range(seq_lens.shape[0]):
        start, end = int(query_start[request]), int(query_start[request + 1])
        seq_len = int(seq_lens[request])
        first = seq_len - (end - start)  # position of the request's first row here
        if not is_prompt[request]:
            first_selected = seq_len - 1
        else:
            first_selected = max(first, prefix)
        positions = torch.arange(min(first_selected, seq_len), seq_len, device=seq_lens.device)
        rows.append(torch.full_like(positions, request))
        tokens.append(start + positions - first)
        contexts.append(positions)
    return torch.cat(rows), torch.cat(tokens), torch.cat(contexts)

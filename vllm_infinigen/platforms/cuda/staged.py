# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: the rows of a host-planned step that attend without the cache.

Rows whose context is below ``--infinigen-min-context`` in a step planned on
the host, and prompt requests whose blocks the device block cache could not
hold (``prompts.py``), attend over their blocks staged from the pool by the
gather kernel: the short rows through ``kernels.attend_units``, the prompts
through a flash-attention kernel over the staged blocks
(``kernels.attend_prompt_units``). A decode step planned on the device never
comes here.
"""

from __future__ import annotations

import torch

from vllm_infinigen.platforms.cuda import kernels
from vllm_infinigen.worker.layer_state import LayerState
from vllm_infinigen.worker.step_plan import RowSet, StepPlan

def attend_dense(layer: LayerState, rows: RowSet, query: torch.Tensor, device: torch.device,
                 counter: torch.Tensor | None = None) -> torch.Tensor:
    """Each row over its whole context, its blocks staged from the pool (no cache);
    ``counter`` (as ``stage``'s)."""
    block_size, heads = layer.block_size, layer.num_kv_heads
    num_rows = rows.size
    width = max(rows.context_host, default=0) // block_size + 1
    context_lens = rows.context_lens.to(device, torch.int64)
    index = torch.arange(width, device=device)
    in_row = index[None, :] <= (context_lens // block_size)[:, None]  # [S, Wb]
    block_table = rows.block_table.to(device, torch.int64)[:, :width]
    block_ids = torch.where(in_row, block_table, -1)
    staged = stage(layer, block_ids.flatten(), device, counter)  # [S * Wb * H + 1, ...]
    # sequence (row s, head h) reads staged unit (s * Wb + j) * H + h for block j
    table = ((torch.arange(num_rows, device=device)[:, None, None] * width
              + index[None, None, :]) * heads
             + torch.arange(heads, device=device)[None, :, None])
    seq_lens = (context_lens + 1)[:, None].expand(num_rows, heads)
    seq_lens = seq_lens.reshape(-1).to(torch.int32)
    out = kernels.attend_units(query.to(device), staged,
                               table.reshape(num_rows * heads, width), seq_lens,
                               num_kv_heads=heads, scale=layer.scale, **layer.kv_scales())
    attended = seq_lens.to(torch.float64).sum() - seq_lens.shape[0]
    context = context_lens.to(torch.float64).sum()
    layer.stats += torch.stack([attended, context]).to(layer.stats.device)
    return out

def attend_prompt(layer: LayerState, plan: StepPlan, request: int, query: torch.Tensor,
                  output: torch.Tensor, device: torch.device,
                  counter: torch.Tensor | None = None) -> None:
    """Causal attention of one prompt request (its index in the step) over its
    blocks staged from the pool (the step's tokens were written through before):
    one gather and one flash-attention kernel on CUDA (``kernels.attend_prompt_units``);
    ``counter`` (as ``stage``'s)."""
    start, end = plan.query_start[request].item(), plan.query_start[request + 1].item()
    seq_len = plan.seq_lens[request].item()  # host tensors
    heads, num_blocks = layer.num_kv_heads, -(-seq_len // layer.block_size)
    block_ids = plan.all_block_table[request, :num_blocks].to(device, torch.int64)
    staged = stage(layer, block_ids, device, counter)
    # staged unit m * H_kv + h holds block m of head h
    table = (torch.arange(num_blocks, device=device)[None, :] * heads
             + torch.arange(heads, device=device)[:, None])
    out = kernels.attend_prompt_units(query[start:end].to(device), staged, table,
                                      first=seq_len - (end - start), seq_len=seq_len,
                                      scale=layer.scale, **layer.kv_scales())
    output[start:end] = out.to(output.device)

def stage(layer: LayerState, block_ids: torch.Tensor, device: torch.device,
          counter: torch.Tensor | None = None) -> torch.Tensor:
    """[M * H_kv + 1, block_size, 2 * D] units of ``block_ids`` [M] (-1: none) from
    the pool, unit (m, h) at m * H_kv + h; the last unit is scratch. ``counter``:
    a device int64 tensor that the units copied are added to (no host read)."""
    heads = layer.num_kv_heads
    count = block_ids.shape[0] * heads
    staged = torch.zeros((count + 1, layer.block_size, 2 * layer.head_size),
                         dtype=layer.kv_pool.dtype, device=device)
    head = torch.arange(heads, device=device)[None, :]
    valid = (block_ids >= 0)[:, None].expand(-1, heads)
    units = torch.where(valid, block_ids.clamp(min=0)[:, None] * heads + head, 0)
    slots = torch.where(valid, torch.arange(count, device=device).view(-1, heads),
                        count)
    kernels.gather_units(layer.kv_pool, staged, units.flatten(), slots.flatten(),
                         torch.tensor([count], dtype=torch.int64, device=device))
    if counter is not None:
        counter += valid.sum()
    return staged

# SPDX-License-Identifier: Apache-2.0
"""Worker side, CUDA platform: prompt rows attend over device memory, not over the pool.

A prompt's tokens are written through to the host pool like every token;
they are also kept in the layer's device block cache, so that the prompt
attends at device speed and its first decode steps find its blocks there::

    place    before the step's write (``CudaDataPath.place_prompts``): each
             prompt request's blocks, every one it attends, take cache slots
             (``DeviceBlockCache.place_prompt``: least recently used first,
             never a slot of the selection in flight for the step's decode
             rows). Of the blocks missing, those holding earlier chunks'
             tokens (chunked prefill) are gathered from the pool; the others
             only receive the step's tokens, which the write stores into the
             cached copies beside the pool (at once, or once a gather in
             flight towards the layer has landed: ``CudaDataPath._flush``).
    attend   each prompt request causally over its cached blocks
             (``kernels.attend_prompt_units`` on the cache units: for a
             16-bit model, torch's SDPA over them gathered in order).

A request whose blocks a head cannot hold (more than the slots the step
leaves free) attends as before over its blocks staged from the pool
(``staged.attend_prompt``): the same result, its context crossing PCIe.
"""

from __future__ import annotations

import torch

from vllm_infinigen.platforms.cuda import kernels, staged
from vllm_infinigen.platforms.cuda.block_cache import DeviceBlockCache
from vllm_infinigen.worker.layer_state import LayerState
from vllm_infinigen.worker.step_plan import StepPlan


def place(cache: DeviceBlockCache, index: int, units: torch.Tensor, layer: LayerState,
          plan: StepPlan, keep: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """Places each prompt request's blocks in sparse layer ``index``'s cache
    and gathers the missing ones that hold earlier steps' tokens, on the
    current stream.

    Args:
        units: The layer's cache units.
        keep: [S, H_kv, W] flat slots of the selection in flight (-1: none), or
            None; neither they nor an earlier request's blocks are evicted.

    Returns:
        request -> [H_kv, n] flat cache slots of its blocks (the attention's
        table), for the requests placed.
    """
    block_size = layer.block_size
    starts, seq_lens = plan.query_start.tolist(), plan.seq_lens.tolist()  # host tensors
    tables = {}
    for request in plan.prompt_requests.tolist():
        seq_len = seq_lens[request]
        first = seq_len - (starts[request + 1] - starts[request])
        block_ids = plan.all_block_table[request, :-(-seq_len // block_size)]
        held = ([] if keep is None else [keep]) + list(tables.values())  # never evicted
        placed = cache.place_prompt(index, block_ids, -(-first // block_size), held)
        if placed is None:
            continue
        tables[request], fetch_units, fetch_slots = placed
        if fetch_units.numel():
            kernels.gather_units(layer.kv_pool, units, fetch_units, fetch_slots,
                                 torch.tensor([fetch_units.numel()], device=units.device))
    return tables


def attend(tables: dict[int, torch.Tensor], units: torch.Tensor, layer: LayerState,
           plan: StepPlan, query: torch.Tensor, output: torch.Tensor, device: torch.device,
           counter: torch.Tensor | None = None) -> None:
    """Causal attention of each prompt request: over its cached blocks where
    ``place`` gave it a table, else over its blocks staged from the pool (their
    units added to ``counter``). query, output: [T, H_q, D]."""
    for request in plan.prompt_requests.tolist():
        table = tables.get(request)
        if table is None:
            staged.attend_prompt(layer, plan, request, query, output, device, counter)
            continue
        start, end = plan.query_start[request].item(), plan.query_start[request + 1].item()
        seq_len = plan.seq_lens[request].item()
        out = kernels.attend_prompt_units(query[start:end].to(device), units, table,
                                          first=seq_len - (end - start), seq_len=seq_len,
                                          scale=layer.scale, **layer.kv_scales())
        output[start:end] = out.to(output.device)

# SPDX-License-Identifier: Apache-2.0
"""``--infinigen-residency device-first``: requests over the pool back in the device blocks,
and a resident request's prefix-cache hit in its sparse blocks.

When the engine returns while requests that ran over the pool are live
(``scheduler/spec.py``, ``Residency.restore``), each gets its sparse groups' blocks
back at its next allocation, and the connector's metadata of that step names it
(``restored``). Its K/V is in the pool (every step writes through to it), addressed
by its dense group's block ids; the worker copies it into the new blocks with the
stock backend's own KV update (its layout, its FP8 scaling) before the forward:

- ``clear_rows``, before the runner takes the step's blocks: the runner still holds
  the sparse block ids freed at the move (the scheduler never told it), so the
  restored request's rows of those groups are emptied, and the new blocks fill
  them from the start (also where a move later in the same step freed them
  again: the metadata's ``cleared``);
- ``copy_from_pool``, once the step's block tables are the runner's (the
  connector's ``bind_connector_metadata``, eagerly, outside any CUDA graph): for
  each sparse layer, the request's blocks of the pool into its new blocks, a
  chunk of blocks at a time. On a GPU the device finishes first: the last steps
  over the pool wrote the pinned pool from its kernels, perhaps still running
  (vLLM's asynchronous scheduling waits for none of them here).

A request admitted while resident with a hit in vLLM's prefix cache gets the dense
group's cached blocks and, in the sparse groups, their cached blocks of the hit (as
many as they have) and fresh ones for the rest of it (``filled``); ``copy_from_pool``
fills those of each sparse group from the pool the same way (the hit's dense slots
address the rows that hold the prefix's K/V; uncapped pools only: the scheduler moves
the engine where the pool is capped).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

import vllm_infinigen.platforms.devices as devices
from vllm_infinigen.worker.layer_state import LayerState


def clear_rows(model_runner, sparse_groups: Collection[int], requests: Collection[str]) -> None:
    """Empties ``requests``' block ids of ``sparse_groups`` in the runner's state and
    its persistent batch (a request not in it is added from its state).

    The persistent batch's block table is pinned host memory that the last step's
    copy to the device may still be reading under async scheduling (vLLM's CUDA
    default): the edit waits for that copy first, as vLLM's own preparation does
    (``GPUModelRunner.synchronize_input_prep``; no event without async scheduling)."""
    event = getattr(model_runner, "prepare_inputs_event", None)
    if event is not None:
        event.synchronize()
    batch = model_runner.input_batch
    for request_id in requests:
        state = model_runner.requests.get(request_id)
        if state is not None:
            for group in sparse_groups:
                state.block_ids[group].clear()
        row = batch.req_id_to_index.get(request_id)
        if row is not None:
            for group in sparse_groups:
                batch.block_table[group].clear_row(row)


# A hair (relative) that K x k_scale is moved away from zero by before vLLM's CPU
# FP8 write divides the scale out again and rounds toward zero: far below the
# format's step (2^-3 at least), far above float32's rounding of the two products.
TOWARD_ZERO_MARGIN = 2.0 ** -20


def pool_entries(state: LayerState, blocks: torch.Tensor, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [len(blocks) * block_size, H_kv, D] of ``blocks`` (dense group ids:
    an uncapped pool's units) in ``dtype``, unscaled (an FP8 pool holds K / k_scale).

    An FP8 pool's entries with scales other than 1.0 come back in float32, a hair
    away from zero, on the CPU build: vLLM's CPU FP8 write rounds toward zero, and
    the products with the scale in ``dtype`` (bfloat16: about half of them under
    k_scale 0.37) or in float32 rounded below the code would lose one code each;
    so they land on the pool's codes, as vLLM's own pages had them. (On CUDA vLLM
    rounds to nearest: ``dtype`` lands there.)"""
    units = state.kv_pool[blocks.to(state.kv_pool.device)].to(device)  # [n, H, B, 2D]
    entries = units.permute(0, 2, 1, 3).flatten(0, 1)  # [n * B, H, 2D]
    scales, head_size = state.kv_scales(), state.head_size
    unit_scales = scales["key_scale"] == 1.0 and scales["value_scale"] == 1.0
    if (entries.dtype.itemsize == 1 and not unit_scales
            and devices.fp8_write_rounding(device) == "toward-zero"):
        dtype, margin = torch.float32, 1.0 + TOWARD_ZERO_MARGIN
    else:
        margin = 1.0
    key, value = entries[..., :head_size].to(dtype), entries[..., head_size:].to(dtype)
    if scales["key_scale"] != 1.0:
        key = key * (scales["key_scale"] * margin)
    if scales["value_scale"] != 1.0:
        value = value * (scales["value_scale"] * margin)
    return key.contiguous(), value.contiguous()


CHUNK_BLOCKS = 256  # blocks a copy reads from the pool at a time (bounds its temporaries)


def copy_from_pool(layers: Collection[LayerState], model_runner, dense_group: int,
                   group_of: Mapping[str, int], requests: Sequence[str],
                   dtype: torch.dtype, device: torch.device,
                   spans: Sequence[tuple[int, int]] | None = None) -> int:
    """Each sparse layer's K/V of ``requests`` from the pool into their blocks of the
    layer's group, through the stock KV update; with ``spans`` (first, end: one per
    request) into those blocks only (a prefix-cache hit's that the group had not
    cached). Returns the blocks copied per layer."""
    devices.synchronize(device)  # the pool's last writes, from every stream
    sources: list[int] = []  # the requests' dense blocks, the same for every group
    targets: dict[int, list[int]] = {group: [] for group in set(group_of.values())}
    for index, request_id in enumerate(requests):
        block_ids = model_runner.requests[request_id].block_ids
        span = slice(0, None) if spans is None else slice(*spans[index])
        for group, blocks in targets.items():
            if len(block_ids[group]) != len(block_ids[dense_group]):  # rows not cleared
                raise RuntimeError(
                    f"InfiniGen: request {request_id} came back from the pool with "
                    f"{len(block_ids[group])} blocks in KV-cache group {group} for its "
                    f"{len(block_ids[dense_group])} in the dense group")
            blocks += block_ids[group][span]
        sources += block_ids[dense_group][span]
    for state in layers:
        block_size = state.kv_pool.shape[2]
        offsets = torch.arange(block_size, device=device)
        for start in range(0, len(sources), CHUNK_BLOCKS):
            chunk = slice(start, start + CHUNK_BLOCKS)
            key, value = pool_entries(state, torch.tensor(sources[chunk]), dtype, device)
            slots = (torch.tensor(targets[group_of[state.layer_name]][chunk], device=device)
                     [:, None] * block_size + offsets)
            state.attention.impl.write_restored(state.attention, key, value, slots.flatten())
    return len(sources)

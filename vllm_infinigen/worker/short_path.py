# SPDX-License-Identifier: Apache-2.0
"""Worker side: a short decode-only step in one data-path call per sparse layer.

Below ``--infinigen-min-context`` every row of a decode step attends densely
over the pool (``StepPlan.short_decode_only``): nothing selects, speculates
or is captured. A sparse layer's step is then its write and that attention,
which the glue of the general path (``InfiniGenRuntime.write`` from the KV
update, or from the forward where vLLM makes no update call:
``attention.writes_in_forward``; ``attend_decode`` from the forward) spreads
over four kernel calls and their Python. Where the data path has
``decode_short`` (the CPU's: one compiled op calling the same kernels), the
layer's forward makes that one call and writes nothing else, and a KV update
that vLLM still calls (device-first residency after the move) does nothing
(``attention.InfiniGenImplMixin``): the same pool, speculation keys, output
and counters. Elsewhere (CUDA), or where a
policy keeps state of the writes (``on_write``: H2O, Quest), the general path
runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_infinigen.policies.base import SelectionPolicy

if TYPE_CHECKING:
    from vllm_infinigen.worker.layer_state import LayerState


class ShortPathMixin:
    """``InfiniGenRuntime``'s short path in one call (its attributes: ``resident``,
    ``data_path``, ``_policies``, ``block_size``, ``plan_for``, ``begin_step``,
    ``row_map``)."""

    # (policies seen, whether any keeps state of the writes): policies are only added.
    _write_consumers: tuple[int, bool] = (0, False)

    def fuses_short(self, attn_metadata) -> bool:
        """Whether each sparse layer runs this step as one call (``decode_short``):
        a short decode-only step, a data path with the op, no policy used so far
        with per-slot state of the writes (every used policy keeps its state
        current), and the sparse layers in the pool (not resident). The same
        answer for a layer's KV update and its forward (the plan is the step's).

        Args:
            attn_metadata: The dense group's attention metadata of the step.
        """
        if self.resident or not self.data_path.has_fused_short:
            return False  # (before the plan: a device data path is not asked to plan here)
        if self._write_consumers[0] != len(self._policies):
            self._write_consumers = (len(self._policies), any(
                type(policy).on_write is not SelectionPolicy.on_write
                for policy in self._policies.values()))
        if self._write_consumers[1]:
            return False
        return self.plan_for(attn_metadata, self.block_size).short_decode_only

    def decode_short(self, state: LayerState, attn_metadata, slot_mapping: torch.Tensor,
                     query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     output: torch.Tensor) -> None:
        """A sparse layer's step when ``fuses_short``: ``write`` and
        ``attend_decode`` in one call of the data path.

        Every request of a short decode-only step decodes one token, so its
        rows are the step's first rows, in order (``dense_rows.tokens`` is
        0..B-1): the op reads ``query`` and writes ``output`` in place.

        Args:
            attn_metadata, slot_mapping: The dense group's metadata and the
                slot of each new token.
            query, output: [T, H_q, D]; key, value: [T, H_kv, D] the new entries.
        """
        self.begin_step(attn_metadata, slot_mapping)
        plan = self.plan_for(attn_metadata, self.block_size)
        self.data_path.decode_short(state, plan.dense_rows, query, key, value, slot_mapping,
                                    self.row_map(state), output)


def skip_sparse_slot_mappings(model_runner, kv_cache_groups) -> list[int]:
    """Stops vLLM's runner computing a slot mapping per step for the sparse
    layers' KV-cache groups (pool residency; ``docs/short_path.md``, option a).

    Their groups hold no blocks and the sparse layers write by the dense
    group's slots (``runtime.reference_layer``), so the per-group slot mapping
    is never read; vLLM's mode for groups without one (Mamba's,
    ``SlotMappingMode.NONE``) makes ``BlockTable.compute_slot_mapping`` return
    at once. Their buffers keep zeros (-1 in a padded tail), which the sparse
    layers' KV update receives and ignores. Not with
    ``--infinigen-residency device-first``: the resident layers write vLLM's
    blocks by it.

    Returns:
        The KV-cache group ids changed.
    """
    from vllm.v1.worker.block_table import SlotMappingMode

    from vllm_infinigen.scheduler.spec import InfiniGenSparseSpec

    changed = []
    for gid, group in enumerate(kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, InfiniGenSparseSpec) and not spec.device_first:
            model_runner.input_batch.block_table[gid].slot_mapping_mode = SlotMappingMode.NONE
            changed.append(gid)
    return changed

# SPDX-License-Identifier: Apache-2.0
"""The CUDA platform's kernels: one wrapper per op, as the data path calls them.

A wrapper takes the op's tensors, launches its Triton kernel when they are
on CUDA (the Triton module imported then, so the CPU build never imports
Triton or touches CUDA) and runs its pure-torch reference elsewhere: in CI,
and in the GPU benchmark's CPU self-test. Nothing here synchronises with the
host. The CPU platform's kernels are C++ (``platforms/cpu/kernels/``)::

    op (wrapper)         Triton kernel                     torch reference
    gather_units         triton_units.gather_units         reference.gather_units_reference
    write_tokens         triton_units.write_tokens         reference.write_pool,
                                                           reference.write_cached_tokens
    write_cached_tokens  triton_units.write_tokens         reference.write_cached_tokens
                         (no pool)
    write_partial_keys   (torch on every device)           -
    encode_groups        triton_units.encode_groups        reference.write_int_keys
    encode_bounds        triton_bounds.encode_bounds       reference.write_bounds
    attend_units         triton_attend.attend_units        reference.attend_units_reference
    attend_prompt_units  triton_prompt.attend_prompt       reference.attend_prompt_units_reference
                         (a float32 query; a 16-bit one:
                         torch's SDPA on every device)
    read_bytes           triton_units.read_bytes           - (CUDA only: host_pool's check)
    int_scores           triton_scoring.int_scores         block_rule.int_token_scores,
                                                           block_rule.block_scores
    bound_scores         triton_bounds.bound_scores        block_rule.bound_unit_scores,
                                                           block_rule.unit_block_scores
    partial_scores       (torch on every device)           -
    alpha_counts         triton_select.alpha_counts        block_rule.alpha_counts_reference
    select               triton_select.select_blocks       block_rule.select_reference
                         (the bound keys' alpha counts     (block_rule.unit_alpha_counts)
                         in the same launch)
    place_lru            triton_lru.lookup_lru             reference.place_lru_reference

The room::

    units.py           the wrappers of the ops on pool units (gather, writes)
    attention.py       the wrappers of the attention over pool units (decode, prompts)
    selection.py       the wrappers of the selection and its placement in the cache
    widths.py          the bounds of a selection's width (and how they relate)
    reference.py       the torch references of the ops on pool units and the placement
    block_rule.py      InfiniGen's rule in blocks in torch: the selection's
                       references, and the host-side rule of the accuracy studies
    triton_units.py    the Triton kernels of gather and writes
    triton_attend.py   the Triton kernel of the decode attention (its splits merged
                       by the last of them)
    triton_prompt.py   the Triton kernel of the prompts' attention
    triton_scoring.py  the Triton kernels scoring tokens from the int keys
    triton_bounds.py   the Triton kernels of the bound keys (encode, score)
    triton_select.py   the Triton kernels of the alpha count and the rule
    triton_lru.py      the Triton kernel placing a selection in the cache (LRU)

An FP8 pool (``--kv-cache-dtype fp8``) holds K / key_scale and V /
value_scale (vLLM's ``k_scale``, ``v_scale``): ``write_tokens`` divides and
rounds, the attention widens and multiplies back (``key_scale`` /
``value_scale`` arguments), the encoders read the pool's values (the scores
then take ``scale * key_scale``), the gather moves bytes.

The tests hold each Triton kernel to its reference in Triton's interpreter
(``tests/unit/triton_interpreter_checks.py``) and on a GPU (``tests/gpu/``),
and the references of the writes to the CPU platform's compiled kernels.
"""

from __future__ import annotations

from vllm_infinigen.platforms.cuda.kernels.selection import (
    SETTINGS,
    DeviceSelection,
    alpha_counts,
    blocks_of_positions,
    bound_scores,
    int_scores,
    partial_scores,
    place_lru,
    select,
    selection_of_blocks,
    settings_tensor,
)
from vllm_infinigen.platforms.cuda.kernels.attention import (
    attend_prompt_units,
    attend_units,
    attention_splits,
    reserve_attention,
)
from vllm_infinigen.platforms.cuda.kernels.units import (
    encode_bounds,
    encode_groups,
    gather_ctas,
    gather_units,
    read_bytes,
    scratch_of,
    unit_words,
    with_scratch_block,
    write_cached_tokens,
    write_partial_keys,
    write_tokens,
)
from vllm_infinigen.platforms.cuda.kernels.widths import static_width, step_width, window_blocks

__all__ = ["SETTINGS", "DeviceSelection", "alpha_counts", "attend_prompt_units", "attend_units",
           "attention_splits", "blocks_of_positions", "bound_scores", "encode_bounds",
           "encode_groups", "gather_ctas", "gather_units", "int_scores", "partial_scores",
           "place_lru", "read_bytes", "reserve_attention", "scratch_of", "select",
           "selection_of_blocks", "settings_tensor", "static_width", "step_width", "unit_words",
           "window_blocks", "with_scratch_block", "write_cached_tokens", "write_partial_keys",
           "write_tokens"]

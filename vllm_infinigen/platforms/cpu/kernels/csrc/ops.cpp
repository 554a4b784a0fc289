// SPDX-License-Identifier: Apache-2.0
// The schemas of InfiniGen's ops, declared once for every platform:
// torch.ops.vllm_infinigen_C.*. Each platform registers its implementations
// under its own dispatch key (the CPU ones: cpu/register.cpp).
#include <torch/library.h>

// key_scale, value_scale: vLLM's k_scale and v_scale (--kv-cache-dtype fp8):
// the pool holds K / key_scale and V / value_scale, and attention multiplies
// them back (the first into the logits' scale, the second into the output).
TORCH_LIBRARY(vllm_infinigen_C, m) {
  // The host write-through: new K|V rows of a sparse layer into its pool.
  m.def(
      "write_pool(Tensor(a!) kv_pool, Tensor key, Tensor value, Tensor slot_mapping, "
      "Tensor? row_map, float key_scale=1.0, float value_scale=1.0) -> ()");
  // The device write: the new keys' skewed partial keys.
  m.def(
      "write_partial_keys(Tensor(a!) partial_keys, Tensor key, Tensor skew, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "select_tokens(Tensor partial_query, Tensor partial_keys, Tensor block_table, "
      "Tensor context_lens, Tensor token_caps, float scale, float alpha, int sink_tokens, "
      "int recent_tokens, Tensor? row_map) -> (Tensor, Tensor)");
  // Integer speculation keys: a 16-token group encoded once its last token is
  // written; selection over them (the open group from the pool's full keys).
  m.def(
      "write_int_keys(Tensor(a!) codes, Tensor(b!) scales, Tensor kv_pool, "
      "Tensor slot_mapping, Tensor? row_map) -> ()");
  m.def(
      "select_tokens_int(Tensor query, Tensor codes, Tensor scales, Tensor kv_pool, "
      "Tensor block_table, Tensor context_lens, Tensor token_caps, float scale, float alpha, "
      "int sink_tokens, int recent_tokens, Tensor? row_map) -> (Tensor, Tensor)");
  // Bound speculation keys: a unit's per-channel max and min keys once its
  // last token is written; selection of whole units by the upper bound of
  // q . k they give (the open unit kept).
  m.def(
      "write_bounds(Tensor(a!) bounds, Tensor(b!) bound_scales, Tensor kv_pool, "
      "Tensor slot_mapping, Tensor? row_map) -> ()");
  m.def(
      "select_bounds(Tensor query, Tensor bounds, Tensor bound_scales, Tensor kv_pool, "
      "Tensor block_table, Tensor context_lens, Tensor token_caps, float scale, float alpha, "
      "int sink_tokens, int recent_tokens, Tensor? row_map) -> (Tensor, Tensor)");
  m.def(
      "attend_decode(Tensor query, Tensor kv_pool, Tensor block_table, Tensor context_lens, "
      "Tensor? positions, Tensor? row_map, float scale, Tensor(a!)? probs, "
      "Tensor(b!)? stats, float key_scale=1.0, float value_scale=1.0) -> Tensor");
  m.def(
      "attend_prefill(Tensor query, Tensor(a!) output, Tensor kv_pool, Tensor block_table, "
      "Tensor query_start, Tensor seq_lens, Tensor requests, Tensor? row_map, "
      "float scale, float key_scale=1.0, float value_scale=1.0) -> ()");
  // The short path in one call: write_pool, the speculation keys' write,
  // attend_decode over every position (a decode step below min_context).
  m.def(
      "decode_short(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_pool, "
      "Tensor slot_mapping, Tensor block_table, Tensor context_lens, Tensor? row_map, "
      "float scale, Tensor(b!)? key_codes, Tensor(c!)? key_scales, Tensor(d!)? partial_keys, "
      "Tensor? skew, Tensor(e!)? stats, Tensor(f!)? out, Tensor(g!)? bounds, "
      "Tensor(h!)? bound_scales, float key_scale=1.0, float value_scale=1.0) -> Tensor");
  // The speculation's query: layer i+1's query projection of layer i's
  // attention input, then its RoPE, in float32.
  m.def(
      "speculation_query(Tensor hidden, Tensor weight, Tensor? bias, Tensor? cos_sin_cache, "
      "Tensor? positions, int head_size, bool is_neox_style) -> Tensor");
  m.def(
      "record_uses(Tensor positions, Tensor block_table, Tensor row_map, Tensor(a!) count, "
      "Tensor(b!) last_used, int tick) -> ()");
}

// SPDX-License-Identifier: Apache-2.0
// Registers InfiniGen's CPU kernels as torch ops: torch.ops.vllm_infinigen_C.*
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(vllm_infinigen_C, m) {
  m.def(
      "write_kv(Tensor(a!) kv_pool, Tensor(b!) partial_keys, Tensor key, Tensor value, "
      "Tensor skew, Tensor slot_mapping, Tensor? row_map) -> ()");
  m.def(
      "select_tokens(Tensor partial_query, Tensor partial_keys, Tensor block_table, "
      "Tensor context_lens, float scale, float alpha, float budget, int sink_tokens, "
      "int recent_tokens, Tensor? row_map) -> (Tensor, Tensor)");
  m.def(
      "attend_decode(Tensor query, Tensor kv_pool, Tensor block_table, Tensor context_lens, "
      "Tensor? positions, Tensor? row_map, float scale, Tensor(a!)? probs, "
      "Tensor(b!)? stats) -> Tensor");
  m.def(
      "attend_prefill(Tensor query, Tensor(a!) output, Tensor kv_pool, Tensor block_table, "
      "Tensor query_start, Tensor seq_lens, Tensor requests, Tensor? row_map, "
      "float scale) -> ()");
  m.def(
      "record_uses(Tensor positions, Tensor block_table, Tensor row_map, Tensor(a!) count, "
      "Tensor(b!) last_used, int tick) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_infinigen_C, CPU, m) {
  m.impl("write_kv", &infinigen::write_kv);
  m.impl("select_tokens", &infinigen::select_tokens);
  m.impl("attend_decode", &infinigen::attend_decode);
  m.impl("attend_prefill", &infinigen::attend_prefill);
  m.impl("record_uses", &infinigen::record_uses);
}

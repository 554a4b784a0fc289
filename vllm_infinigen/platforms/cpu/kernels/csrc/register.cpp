// SPDX-License-Identifier: Apache-2.0
// The CPU implementations of InfiniGen's ops (schemas: ../ops.cpp).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY_IMPL(vllm_infinigen_C, CPU, m) {
  m.impl("write_pool", &infinigen::write_pool);
  m.impl("write_partial_keys", &infinigen::write_partial_keys);
  m.impl("select_tokens", &infinigen::select_tokens);
  m.impl("write_int_keys", &infinigen::write_int_keys);
  m.impl("select_tokens_int", &infinigen::select_tokens_int);
  m.impl("write_bounds", &infinigen::write_bounds);
  m.impl("select_bounds", &infinigen::select_bounds);
  m.impl("attend_decode", &infinigen::attend_decode);
  m.impl("attend_prefill", &infinigen::attend_prefill);
  m.impl("decode_short", &infinigen::decode_short);
  m.impl("record_uses", &infinigen::record_uses);
  m.impl("speculation_query", &infinigen::speculation_query);
}

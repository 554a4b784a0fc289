// SPDX-License-Identifier: Apache-2.0
// The short path of a sparse layer in one op: a decode step whose rows all sit
// below --infinigen-min-context writes its new K|V (and speculation keys) and
// attends every row densely over the pool. The op calls the kernels the step
// would call one by one (write_pool, write_int_keys, write_bounds or
// write_partial_keys,
// attend_decode in dense mode): the same results and counts, with one dispatch
// from Python instead of four and none of the glue between them.
#include "ops.h"

namespace infinigen {

at::Tensor decode_short(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        at::Tensor& kv_pool, const at::Tensor& slot_mapping,
                        const at::Tensor& block_table, const at::Tensor& context_lens,
                        const std::optional<at::Tensor>& row_map, double scale,
                        const std::optional<at::Tensor>& key_codes,
                        const std::optional<at::Tensor>& key_scales,
                        const std::optional<at::Tensor>& partial_keys,
                        const std::optional<at::Tensor>& skew,
                        const std::optional<at::Tensor>& stats,
                        const std::optional<at::Tensor>& out,
                        const std::optional<at::Tensor>& bounds,
                        const std::optional<at::Tensor>& bound_scales, double key_scale,
                        double value_scale) {
  TORCH_CHECK(key_codes.has_value() == key_scales.has_value(),
              "decode_short: key_codes and key_scales go together (the int keys)");
  TORCH_CHECK(partial_keys.has_value() == skew.has_value(),
              "decode_short: partial_keys and skew go together (the partial keys)");
  TORCH_CHECK(bounds.has_value() == bound_scales.has_value(),
              "decode_short: bounds and bound_scales go together (the bounds)");
  TORCH_CHECK(key_codes.has_value() + partial_keys.has_value() + bounds.has_value() <= 1,
              "decode_short: a layer keeps one form of speculation keys");
  const int64_t num_rows = context_lens.size(0);
  TORCH_CHECK(query.dim() == 3 && query.size(0) >= num_rows,
              "decode_short: query [T, H_q, D] with a row per entry of context_lens");
  // As the runtime's write: slot ids as int64 (a no-op for vLLM's).
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();

  // The write-through first: the int keys and bounds are encoded from the pool, and each
  // row attends over its own new entry.
  write_pool(kv_pool, key, value, slots, row_map, key_scale, value_scale);
  if (key_codes.has_value()) {
    // Encodes only where a slot closes a 16-token group (write_int_keys returns
    // at once in a step without one).
    at::Tensor codes = *key_codes, scales = *key_scales;
    write_int_keys(codes, scales, kv_pool, slots, row_map);
  } else if (bounds.has_value()) {
    // Summarises only where a slot closes a unit (returns at once otherwise).
    at::Tensor codes = *bounds, scales = *bound_scales;
    write_bounds(codes, scales, kv_pool, slots, row_map);
  } else if (partial_keys.has_value()) {
    at::Tensor partial = *partial_keys;
    write_partial_keys(partial, key, *skew, slots);
  }

  // Every row densely (positions None), over the step's first num_rows query rows.
  at::Tensor result = attend_decode(query.narrow(0, 0, num_rows), kv_pool, block_table,
                                    context_lens, std::nullopt, row_map, scale, std::nullopt,
                                    stats, key_scale, value_scale);
  if (out.has_value()) {
    TORCH_CHECK(out->size(0) >= num_rows && out->size(1) == result.size(1) &&
                    out->size(2) == result.size(2) && out->scalar_type() == result.scalar_type(),
                "decode_short: out [T, H_q, D] in the query's dtype");
    out->narrow(0, 0, num_rows).copy_(result);
  }
  return result;
}

}  // namespace infinigen

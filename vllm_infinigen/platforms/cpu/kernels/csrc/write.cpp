// SPDX-License-Identifier: Apache-2.0
// A sparse layer's writes of its new tokens: the host write-through of K|V to
// the pool, and the device write of their partial keys.
#include "ops.h"

namespace infinigen {

// key, value: [T, H_kv, D] (last dim contiguous); slot_mapping: [T] int64 slot
// ids of the dense group (< 0: padding, skipped). kv_pool: [units, H_kv,
// block_size, 2 * D]; row_map: a capped pool's rows (evicted: not written).
void write_pool(at::Tensor& kv_pool, const at::Tensor& key, const at::Tensor& value,
                const at::Tensor& slot_mapping, const std::optional<at::Tensor>& row_map,
                double key_scale, double value_scale) {
  TORCH_CHECK(key_scale > 0 && value_scale > 0, "write_pool: key_scale and value_scale > 0");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value: [T, H_kv, D]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value: last dim contiguous");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "key and value must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping: contiguous int64");
  const int64_t num_tokens = std::min(key.size(0), slot_mapping.size(0));
  const int64_t num_heads = key.size(1), head_size = key.size(2);
  const PoolLayout layout = pool_layout(kv_pool, row_map);
  const int64_t block_size = layout.block_size;
  TORCH_CHECK(kv_pool.size(1) == num_heads && kv_pool.size(3) == 2 * head_size,
              "kv_pool does not match key: [units, H_kv, block_size, 2 * D]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t pool_numel = kv_pool.numel();
  const int64_t num_blocks =
      row_map.has_value() ? row_map->size(0) : kv_pool.size(0);

  // An FP8 pool takes the model's K/V over their scales, rounded to its format
  // (saturating, to_kv).
  const bool unscaled = key_scale == 1.0 && value_scale == 1.0;
  const float key_inv = static_cast<float>(1.0 / key_scale);
  const float value_inv = static_cast<float>(1.0 / value_scale);
  INFINIGEN_DISPATCH_POOL_QUERY(kv_pool.scalar_type(), key.scalar_type(), "write_pool", [&] {
    scalar_t* pool = kv_pool.data_ptr<scalar_t>();
    const query_t* key_data = key.data_ptr<query_t>();
    const query_t* value_data = value.data_ptr<query_t>();
    at::parallel_for(0, num_tokens * num_heads, 16, [&](int64_t begin, int64_t end) {
      for (int64_t index = begin; index < end; ++index) {
        const int64_t token = index / num_heads, head = index % num_heads;
        const int64_t slot = slots[token];
        if (slot < 0) continue;
        const int64_t block_id = slot / block_size, offset = slot % block_size;
        TORCH_CHECK(block_id < num_blocks, "slot ", slot, " beyond the pool");
        const int64_t entry = layout.entry(block_id, head, offset);
        if (entry < 0) continue;
        TORCH_CHECK(entry + 2 * head_size <= pool_numel, "pool row beyond the pool");
        const query_t* k = key_data + token * key.stride(0) + head * key.stride(1);
        const query_t* v = value_data + token * value.stride(0) + head * value.stride(1);
        if constexpr (std::is_same_v<query_t, scalar_t>) {
          if (unscaled) {
            std::copy(k, k + head_size, pool + entry);
            std::copy(v, v + head_size, pool + entry + head_size);
            continue;
          }
        }
        for (int64_t d = 0; d < head_size; ++d) {
          pool[entry + d] = to_kv<scalar_t>(static_cast<float>(k[d]) * key_inv);
          pool[entry + head_size + d] = to_kv<scalar_t>(static_cast<float>(v[d]) * value_inv);
        }
      }
    });
  });
}

// key: [T, H_kv, D] (last dim contiguous); skew: [H_kv, D, R] float32;
// slot_mapping: [T] int64 (< 0: padding). partial_keys: [num_blocks, H_kv, R,
// block_size] (channel-major per block: scoring a block reads R rows of
// block_size values); partial key = key @ skew[head].
void write_partial_keys(at::Tensor& partial_keys, const at::Tensor& key, const at::Tensor& skew,
                        const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1, "key: [T, H_kv, D], last dim contiguous");
  TORCH_CHECK(key.scalar_type() == partial_keys.scalar_type(),
              "key and partial_keys must share a dtype");
  TORCH_CHECK(skew.scalar_type() == at::kFloat && skew.is_contiguous() && skew.dim() == 3,
              "skew: contiguous float32 [H_kv, D, R]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping: contiguous int64");
  TORCH_CHECK(partial_keys.is_contiguous() && partial_keys.dim() == 4, "partial_keys: 4-d");
  const int64_t num_tokens = std::min(key.size(0), slot_mapping.size(0));
  const int64_t num_heads = key.size(1), head_size = key.size(2);
  const int64_t rank = skew.size(2);
  const int64_t num_blocks = partial_keys.size(0), block_size = partial_keys.size(3);
  TORCH_CHECK(partial_keys.size(1) == num_heads && partial_keys.size(2) == rank,
              "partial_keys must be [num_blocks, H_kv, R, block_size]");
  TORCH_CHECK(skew.size(0) == num_heads && skew.size(1) == head_size, "skew: [H_kv, D, R]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* skew_data = skew.data_ptr<float>();

  // skew_by_rank: [H_kv, R, D], so that each partial channel is a contiguous dot product.
  std::vector<float> skew_by_rank(num_heads * rank * head_size);
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d = 0; d < head_size; ++d)
      for (int64_t r = 0; r < rank; ++r)
        skew_by_rank[(h * rank + r) * head_size + d] = skew_data[(h * head_size + d) * rank + r];
  const int64_t full = head_size - head_size % kVecSize;

  INFINIGEN_DISPATCH_KV(partial_keys.scalar_type(), "write_partial_keys", [&] {
    scalar_t* partial = partial_keys.data_ptr<scalar_t>();
    const scalar_t* key_data = key.data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens * num_heads, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> key_float(head_size);
      for (int64_t index = begin; index < end; ++index) {
        const int64_t token = index / num_heads, head = index % num_heads;
        const int64_t slot = slots[token];
        if (slot < 0) continue;
        const int64_t block_id = slot / block_size, offset = slot % block_size;
        TORCH_CHECK(block_id < num_blocks, "slot ", slot, " beyond the partial keys");
        const scalar_t* k = key_data + token * key.stride(0) + head * key.stride(1);
        for (int64_t d = 0; d < head_size; ++d) key_float[d] = static_cast<float>(k[d]);
        // partial key = key @ skew[head]: [D] x [D, R].
        scalar_t* out = partial + ((block_id * num_heads + head) * rank) * block_size + offset;
        for (int64_t r = 0; r < rank; ++r) {
          const float* column = skew_by_rank.data() + (head * rank + r) * head_size;
          fVec acc(0.f);
          int64_t d = 0;
          for (; d < full; d += kVecSize)
            acc = at::vec::fmadd(fVec::loadu(key_float.data() + d), fVec::loadu(column + d), acc);
          float total = sum_lanes(acc);
          for (; d < head_size; ++d) total += key_float[d] * column[d];
          out[r * block_size] = static_cast<scalar_t>(total);
        }
      }
    });
  });
}

}  // namespace infinigen

// SPDX-License-Identifier: Apache-2.0
// Causal attention of a sparse layer's prompt rows over the pool.
//
// Per request and KV head, the context is gathered from the pool once (block
// runs of K|V rows) and attended with ATen's CPU flash attention in two parts
// merged by their log-sum-exp:
//
//   positions  0 .. first-1     earlier chunks: every query row sees all (no mask)
//   positions  first .. end-1   this step's rows: causal (query i sees first..first+i)
//
// Entries a capped pool evicted are left out of the first part.
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>

#include "ops.h"

namespace infinigen {

void attend_prefill(const at::Tensor& query, at::Tensor& output, const at::Tensor& kv_pool,
                    const at::Tensor& block_table, const at::Tensor& query_start,
                    const at::Tensor& seq_lens, const at::Tensor& requests,
                    const std::optional<at::Tensor>& row_map, double scale, double key_scale,
                    double value_scale) {
  scale *= key_scale;  // the pool holds K / key_scale and V / value_scale
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [T, H_q, D]");
  TORCH_CHECK(output.sizes() == query.sizes() && output.scalar_type() == query.scalar_type(),
              "output must match query");
  TORCH_CHECK(query.scalar_type() == kv_pool.scalar_type() || kv_pool.element_size() == 1,
              "query and kv_pool: one dtype, or an FP8 pool");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table: int32 [num_reqs, max_blocks]");
  TORCH_CHECK(query_start.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  requests.scalar_type() == at::kLong && query_start.is_contiguous() &&
                  seq_lens.is_contiguous() && requests.is_contiguous(),
              "query_start, seq_lens, requests: contiguous int64");
  const PoolLayout layout = pool_layout(kv_pool, row_map);
  const int64_t num_heads = layout.num_heads, head_size = query.size(2);
  const int64_t group = query.size(1) / num_heads, block_size = layout.block_size;
  TORCH_CHECK(kv_pool.size(3) == 2 * head_size, "kv_pool rows must be 2 * head size");
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* reqs = requests.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);

  for (int64_t r = 0; r < requests.numel(); ++r) {
    const int64_t req = reqs[r];
    const int64_t q_begin = starts[req], q_end = starts[req + 1], seq_len = lens[req];
    const int64_t num_queries = q_end - q_begin;
    if (num_queries <= 0) continue;
    const int64_t first = seq_len - num_queries;
    const int32_t* blocks = table + req * table_stride;
    // keys, values: [H_kv, seq_len, D] in the query's dtype (an FP8 pool's
    // widened); earlier[h]: how many of 0..first-1 are held.
    auto keys = at::empty({num_heads, seq_len, head_size}, query.options());
    auto values = at::empty_like(keys);
    std::vector<int64_t> earlier(num_heads, 0);
    INFINIGEN_DISPATCH_POOL_QUERY(kv_pool.scalar_type(), query.scalar_type(), "attend_prefill",
                                  [&] {
      const scalar_t* pool = kv_pool.data_ptr<scalar_t>();
      query_t* key_out = keys.data_ptr<query_t>();
      query_t* value_out = values.data_ptr<query_t>();
      at::parallel_for(0, num_heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t h = begin; h < end; ++h) {
          query_t* k_dst = key_out + h * seq_len * head_size;
          query_t* v_dst = value_out + h * seq_len * head_size;
          int64_t held = 0;
          for (int64_t p = 0; p < seq_len; ++p) {
            const int64_t entry = layout.entry(blocks[p / block_size], h, p % block_size);
            if (entry < 0) {
              TORCH_CHECK(p < first, "a token of this step is not in the pool");
              continue;
            }
            if constexpr (std::is_same_v<query_t, scalar_t>) {
              std::copy(pool + entry, pool + entry + head_size, k_dst + held * head_size);
              std::copy(pool + entry + head_size, pool + entry + 2 * head_size,
                        v_dst + held * head_size);
            } else {
              for (int64_t d = 0; d < head_size; ++d) {
                k_dst[held * head_size + d] = static_cast<query_t>(static_cast<float>(pool[entry + d]));
                v_dst[held * head_size + d] =
                    static_cast<query_t>(static_cast<float>(pool[entry + head_size + d]));
              }
            }
            ++held;
          }
          earlier[h] = held - num_queries;
        }
      });
    });
    for (int64_t h = 0; h < num_heads; ++h) {
      // q: [1, G, T, D] view of this request's rows and the KV head's query group.
      auto q = query.slice(0, q_begin, q_end)
                   .slice(1, h * group, (h + 1) * group)
                   .transpose(0, 1)
                   .unsqueeze(0);
      auto k_all = keys[h], v_all = values[h];
      auto as_group = [&](const at::Tensor& part) {
        return part.unsqueeze(0).unsqueeze(0).expand({1, group, part.size(0), head_size});
      };
      const int64_t held = earlier[h];
      auto [recent_out, recent_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
          q, as_group(k_all.slice(0, held, held + num_queries)),
          as_group(v_all.slice(0, held, held + num_queries)), 0.0, /*is_causal=*/true,
          std::nullopt, scale);
      at::Tensor result = recent_out;  // [1, G, T, D]
      if (held > 0) {
        auto [early_out, early_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
            q, as_group(k_all.slice(0, 0, held)), as_group(v_all.slice(0, 0, held)), 0.0,
            /*is_causal=*/false, std::nullopt, scale);
        // Merge the two softmaxes: weights exp(lse - max) of each part.
        auto top = at::maximum(recent_lse, early_lse);
        auto w_recent = (recent_lse - top).exp().unsqueeze(-1);
        auto w_early = (early_lse - top).exp().unsqueeze(-1);
        result = (recent_out.to(at::kFloat) * w_recent + early_out.to(at::kFloat) * w_early) /
                 (w_recent + w_early);
      }
      if (value_scale != 1.0) result = result.to(at::kFloat) * value_scale;
      output.slice(0, q_begin, q_end)
          .slice(1, h * group, (h + 1) * group)
          .copy_(result[0].transpose(0, 1));
    }
  }
}

}  // namespace infinigen

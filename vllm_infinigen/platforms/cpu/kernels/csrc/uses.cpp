// SPDX-License-Identifier: Apache-2.0
// A capped pool's use counts: every selected entry's counter and last use.
#include "ops.h"

namespace infinigen {

// positions: [B, H_kv, K] int32 (-1: none); block_table: [B, max_blocks] int32;
// row_map: [num_blocks, H_kv, block_size] int32; count, last_used: [H_kv, rows]
// int64, the layer's. Each selected entry held by the pool gets count + 1 and
// last_used = tick.
void record_uses(const at::Tensor& positions, const at::Tensor& block_table,
                 const at::Tensor& row_map, at::Tensor& count, at::Tensor& last_used,
                 int64_t tick) {
  TORCH_CHECK(positions.scalar_type() == at::kInt && positions.is_contiguous() &&
                  positions.dim() == 3, "positions: contiguous int32 [B, H_kv, K]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table: int32 [B, max_blocks]");
  TORCH_CHECK(row_map.scalar_type() == at::kInt && row_map.is_contiguous() && row_map.dim() == 3,
              "row_map: contiguous int32 [num_blocks, H_kv, block_size]");
  TORCH_CHECK(count.scalar_type() == at::kLong && last_used.scalar_type() == at::kLong &&
                  count.is_contiguous() && last_used.is_contiguous() &&
                  count.sizes() == last_used.sizes() && count.dim() == 2,
              "count, last_used: contiguous int64 [H_kv, rows]");
  const int64_t num_rows = positions.size(0), num_heads = positions.size(1);
  const int64_t width = positions.size(2), block_size = row_map.size(2);
  const int64_t pool_rows = count.size(1);
  const int32_t* pos = positions.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* map = row_map.data_ptr<int32_t>();
  int64_t* counts = count.data_ptr<int64_t>();
  int64_t* last = last_used.data_ptr<int64_t>();
  // Each head owns its rows: heads in parallel, no two threads touch one row.
  at::parallel_for(0, num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t b = 0; b < num_rows; ++b) {
        const int32_t* sel = pos + (b * num_heads + h) * width;
        const int32_t* blocks = table + b * block_table.stride(0);
        for (int64_t i = 0; i < width; ++i) {
          if (sel[i] < 0) continue;
          const int64_t block_id = blocks[sel[i] / block_size];
          const int32_t row = map[(block_id * num_heads + h) * block_size + sel[i] % block_size];
          if (row < 0) continue;
          TORCH_CHECK(row < pool_rows, "row beyond the pool");
          counts[h * pool_rows + row] += 1;
          last[h * pool_rows + row] = tick;
        }
      }
    }
  });
}

}  // namespace infinigen

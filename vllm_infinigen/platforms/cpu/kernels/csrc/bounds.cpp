// SPDX-License-Identifier: Apache-2.0
// Bound speculation keys: per unit of U tokens and KV head, each channel's
// largest and smallest key in `bits` bits (Quest's page summary), and a
// selection of whole units by the upper bound of q . k they give.
//
//   bounds        [num_blocks, H_kv, block_size / U, 2, D * bits / 8] uint8
//                 row 0 the maxima, row 1 the minima, as codes c = v / s + off,
//                 off = 2^(bits-1): 8 bits one channel per byte; 4 bits byte j
//                 holds channel j (low nibble) and channel j + D/2 (high)
//   bound_scales  [num_blocks, H_kv, block_size / U] float16 s per unit
//
// Rounded outwards (maxima up, minima down) with s = max |key| / (off - 1)
// rounded up to float16, so that (max code - off) * s >= every key of the
// channel and (min code - off) * s <= every key: a unit's score
//   s * max over the query group of sum_c max(q_c * max_c, q_c * min_c)
// bounds q . k of each of its tokens. A unit is summarised when its last token
// is written (from the keys in the pool). A selection scores each complete
// unit of a row's context (2 D multiply-adds per unit and query head, not per
// token), keeps the row's own unit (its context ends inside it: no bound
// yet; its most recent k tokens when the row's k is smaller) and each KV
// head's best units, and returns their tokens.
#include "bound_scoring.h"
#include "ops.h"

namespace infinigen {
namespace {

using bound_scoring::group_bound;
using bound_scoring::group_pair_bound8;

struct BoundShape {
  int64_t units;  // per block
  int64_t unit;  // tokens per unit
  int64_t bits;
  int64_t row_bytes;  // one row of codes: D * bits / 8
};

BoundShape bound_shape(const at::Tensor& bounds, const at::Tensor& scales, int64_t block_size,
                       int64_t head_size) {
  TORCH_CHECK(bounds.scalar_type() == at::kByte && bounds.is_contiguous() && bounds.dim() == 5 &&
                  bounds.size(3) == 2,
              "bounds: contiguous uint8 [num_blocks, H_kv, block_size / U, 2, D * bits / 8]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == bounds.size(0) && scales.size(1) == bounds.size(1) &&
                  scales.size(2) == bounds.size(2),
              "bound_scales: contiguous float16 [num_blocks, H_kv, block_size / U]");
  const int64_t units = bounds.size(2), row_bytes = bounds.size(4);
  TORCH_CHECK(units > 0 && block_size % units == 0, "bounds: U must divide the block");
  TORCH_CHECK(head_size % 2 == 0 && (row_bytes == head_size || 2 * row_bytes == head_size),
              "bounds: D * bits / 8 bytes per row, 8 or 4 bits, D even");
  return {units, block_size / units, row_bytes == head_size ? 8 : 4, row_bytes};
}

// The float16 at or above `value` (> 0) nearest to it.
at::Half half_at_least(float value) {
  at::Half h(value);
  if (static_cast<float>(h) < value) h.x = static_cast<uint16_t>(h.x + 1);  // positive: next up
  return h;
}

}  // namespace

void write_bounds(at::Tensor& bounds, at::Tensor& scales, const at::Tensor& kv_pool,
                  const at::Tensor& slot_mapping, const std::optional<at::Tensor>& row_map) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping: contiguous int64");
  const PoolLayout layout = pool_layout(kv_pool, row_map);
  const int64_t num_blocks = bounds.size(0), num_heads = bounds.size(1);
  const int64_t head_size = kv_pool.size(3) / 2, block_size = layout.block_size;
  const BoundShape shape = bound_shape(bounds, scales, block_size, head_size);
  TORCH_CHECK(kv_pool.size(1) == num_heads, "kv_pool does not match the bounds' KV heads");
  const int64_t unit = shape.unit, bits = shape.bits, half = head_size / 2;
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto closes_unit = [unit](int64_t slot) { return slot >= 0 && slot % unit == unit - 1; };
  if (std::none_of(slots, slots + num_tokens, closes_unit)) return;
  const float offset = static_cast<float>(1 << (bits - 1)), top = offset - 1.f;
  const float largest_code = static_cast<float>((1 << bits) - 1);
  uint8_t* code_data = bounds.data_ptr<uint8_t>();
  at::Half* scale_data = scales.data_ptr<at::Half>();

  INFINIGEN_DISPATCH_POOL(kv_pool.scalar_type(), "write_bounds", [&] {
    const scalar_t* pool = kv_pool.data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens * num_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> high(head_size), low(head_size);
      for (int64_t index = begin; index < end; ++index) {
        const int64_t token = index / num_heads, head = index % num_heads;
        const int64_t slot = slots[token];
        if (!closes_unit(slot)) continue;
        const int64_t block_id = slot / block_size, offset_in_block = slot % block_size;
        TORCH_CHECK(block_id < num_blocks, "slot ", slot, " beyond the bounds");
        const int64_t first = offset_in_block / unit * unit;
        std::fill(high.begin(), high.end(), kNegInf);
        std::fill(low.begin(), low.end(), kPosInf);
        bool any = false;  // a capped pool's evicted entries are left out
        for (int64_t t = 0; t < unit; ++t) {
          const int64_t entry = layout.entry(block_id, head, first + t);
          if (entry < 0) continue;
          any = true;
          const scalar_t* key = pool + entry;
          int64_t d = 0;
          for (; d + kVecSize <= head_size; d += kVecSize) {
            const fVec k = load_float(key + d);
            at::vec::maximum(fVec::loadu(high.data() + d), k).store(high.data() + d);
            at::vec::minimum(fVec::loadu(low.data() + d), k).store(low.data() + d);
          }
          for (; d < head_size; ++d) {
            high[d] = std::max(high[d], static_cast<float>(key[d]));
            low[d] = std::min(low[d], static_cast<float>(key[d]));
          }
        }
        float magnitude = 0.f;
        if (any)
          for (int64_t d = 0; d < head_size; ++d)
            magnitude = std::max(magnitude, std::max(std::abs(high[d]), std::abs(low[d])));
        const int64_t cell = (block_id * num_heads + head) * shape.units + first / unit;
        const at::Half scale = magnitude > 0.f ? half_at_least(magnitude / top) : at::Half(0.f);
        scale_data[cell] = scale;
        const float step = static_cast<float>(scale);
        uint8_t* rows = code_data + cell * 2 * shape.row_bytes;
        std::fill(rows, rows + 2 * shape.row_bytes, static_cast<uint8_t>(0));
        for (int64_t d = 0; d < head_size; ++d) {
          // Outwards: the maximum up, the minimum down (no keys, or all zero: both
          // codes at the offset, the value 0).
          float up = offset, down = offset;
          if (step > 0.f) {
            up = std::min(largest_code, std::max(0.f, std::ceil(high[d] / step) + offset));
            down = std::min(largest_code, std::max(0.f, std::floor(low[d] / step) + offset));
          }
          const float codes[2] = {up, down};
          for (int64_t r = 0; r < 2; ++r) {
            uint8_t* row = rows + r * shape.row_bytes;
            const auto code = static_cast<uint8_t>(codes[r]);
            if (bits == 8)
              row[d] = code;
            else if (d < half)
              row[d] |= code;
            else
              row[d - half] |= static_cast<uint8_t>(code << 4);
          }
        }
      }
    });
  });
}

std::tuple<at::Tensor, at::Tensor> select_bounds(
    const at::Tensor& query, const at::Tensor& bounds, const at::Tensor& scales,
    const at::Tensor& kv_pool,
    const at::Tensor& block_table, const at::Tensor& context_lens, const at::Tensor& token_caps,
    double scale, double alpha, int64_t sink_tokens, int64_t recent_tokens,
    const std::optional<at::Tensor>& row_map) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.is_contiguous() && query.dim() == 4,
              "query: contiguous float32 [B, H_kv, G_q, D]");
  check_selection_rows(block_table, context_lens, token_caps);
  const int64_t num_rows = query.size(0), num_heads = query.size(1);
  const int64_t query_group = query.size(2), head_size = query.size(3);
  const PoolLayout layout = pool_layout(kv_pool, row_map);
  const int64_t block_size = layout.block_size;
  const BoundShape shape = bound_shape(bounds, scales, block_size, head_size);
  TORCH_CHECK(bounds.size(1) == num_heads && kv_pool.size(3) == 2 * head_size,
              "bounds do not match the query");
  const int64_t unit = shape.unit, units_per_block = shape.units, bits = shape.bits;
  const int64_t half = head_size / 2;
  // Channels scored a vector at a time: [0, D) in 8 bits; [0, D/2) and
  // [D/2, D) in 4 bits (a byte's two nibbles); the rest one by one.
  const int64_t segment = bits == 8 ? head_size : half;
  const int64_t vector_end = segment / kVecSize * kVecSize;
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* caps = token_caps.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  int64_t max_len = 0;
  for (int64_t b = 0; b < num_rows; ++b) max_len = std::max(max_len, lens[b]);
  const int64_t max_units = max_len / unit;  // complete units of the longest row
  const int64_t num_blocks_max = (max_len + block_size - 1) / block_size;
  static thread_local std::vector<float> score_buffer;  // [B, H_kv, max_units]
  float* scores = scratch_floats(score_buffer, num_rows * num_heads * max_units);
  const float* queries = query.data_ptr<float>();
  const uint8_t* code_data = bounds.data_ptr<uint8_t>();
  const at::Half* scale_data = scales.data_ptr<at::Half>();
  const float scale_f = static_cast<float>(scale);
  const float code_offset = static_cast<float>(1 << (bits - 1));
  // Per (row, KV head, query head): the query's positive and negative parts,
  // which take the maxima and the minima, and offset x sum of the query.
  std::vector<float> weights(num_rows * num_heads * query_group * 2 * head_size);
  std::vector<float> offsets(num_rows * num_heads * query_group);
  for (int64_t i = 0; i < num_rows * num_heads * query_group; ++i) {
    const float* q = queries + i * head_size;
    float* w = weights.data() + i * 2 * head_size;
    float total = 0.f;
    for (int64_t d = 0; d < head_size; ++d) {
      w[d] = std::max(q[d], 0.f);
      w[head_size + d] = std::min(q[d], 0.f);
      total += q[d];
    }
    offsets[i] = code_offset * total;
  }
  auto present = [&](int64_t b, int64_t h, int64_t t) {
    if (layout.row_map == nullptr) return true;
    const int64_t block_id = table[b * table_stride + t / block_size];
    return layout.entry(block_id, h, t % block_size) >= 0;
  };

  // Pass 1: each complete unit's score, scale x s x max over the query group
  // of (q+ . max codes + q- . min codes - offset x sum q); a unit the capped
  // pool evicted whole scores -inf.
  const bool paired_codes = bits == 8 && head_size % kVecSize == 0;
  at::parallel_for(0, num_rows * num_blocks_max, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> pair_buffer(units_per_block);
    float* pair_best = pair_buffer.data();
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / num_blocks_max, j = index % num_blocks_max;
      const int64_t complete = lens[b] / unit, first_unit = j * units_per_block;
      if (first_unit >= complete) continue;
      const int64_t block_id = table[b * table_stride + j];
      const int64_t count = std::min(units_per_block, complete - first_unit);
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* w = weights.data() + (b * num_heads + h) * query_group * 2 * head_size;
        const float* offs = offsets.data() + (b * num_heads + h) * query_group;
        float* out = scores + (b * num_heads + h) * max_units + first_unit;
        const int64_t first_cell = (block_id * num_heads + h) * units_per_block;
        int64_t paired = 0;
        if (paired_codes) {  // two units at a time, their bounds kept in pair_best
          for (; paired + 1 < count; paired += 2) {
            const uint8_t* rows = code_data + (first_cell + paired) * 2 * shape.row_bytes;
            group_pair_bound8(rows, rows + 2 * shape.row_bytes, head_size, w, offs,
                              query_group, pair_best + paired);
          }
        }
        for (int64_t u = 0; u < count; ++u) {
          const int64_t cell = first_cell + u;
          const uint8_t* rows = code_data + cell * 2 * shape.row_bytes;
          const float best = u < paired ? pair_best[u]
                                        : group_bound(rows, shape.row_bytes, w, offs,
                                                      query_group, bits, head_size, segment,
                                                      vector_end);
          out[u] = best * static_cast<float>(scale_data[cell]) * scale_f;
          if (layout.row_map != nullptr) {
            const int64_t start = (first_unit + u) * unit;
            bool any = false;
            for (int64_t t = start; t < start + unit && !any; ++t) any = present(b, h, t);
            if (!any) out[u] = kNegInf;
          }
        }
      }
    }
  });

  // Pass 2: the row's k, as the token rule's: min(floor(mean over KV heads of
  // the tokens of the units within alpha of the head's best), the budget); the
  // own unit's tokens count in it (its most recent k when k is smaller), the
  // complete units share the rest.
  std::vector<int64_t> rest_of_row(num_rows), own_of_row(num_rows);
  for (int64_t b = 0; b < num_rows; ++b) {
    const int64_t n = lens[b], complete = n / unit, own = n - complete * unit;
    int64_t total = 0;
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* s = scores + (b * num_heads + h) * max_units;
      float best = kNegInf;
      for (int64_t u = 0; u < complete; ++u) best = std::max(best, s[u]);
      const float limit = best - static_cast<float>(alpha);
      int64_t within = 0;
      for (int64_t u = 0; u < complete; ++u) within += s[u] > limit;
      total += within * unit + own;
    }
    const int64_t mean = static_cast<int64_t>(
        std::floor(static_cast<double>(total) / static_cast<double>(num_heads)));
    const int64_t k = std::min(mean, caps[b]);
    own_of_row[b] = std::min(own, k);  // its most recent tokens, when k is smaller
    rest_of_row[b] = k - own_of_row[b];
  }

  // Pass 3: each head takes the tokens of its best units (ties in position
  // order) up to the rest: whole units, then the first tokens of the next one
  // (what the token rule keeps when a unit's tokens share its score); then
  // its tokens, ascending: the sink/recent windows, the taken, the own unit.
  std::vector<std::vector<int64_t>> taken(num_rows * num_heads);  // tokens per unit
  std::vector<int64_t> widths(num_rows * num_heads);
  auto emit = [&](int64_t b, int64_t h, const std::vector<int64_t>& take, int32_t* dst) {
    const int64_t n = lens[b], complete = n / unit;
    int64_t written = 0;
    auto put = [&](int64_t t) {
      if (dst != nullptr) dst[written] = static_cast<int32_t>(t);
      ++written;
    };
    for (int64_t u = 0; u < complete; ++u) {
      const int64_t start = u * unit, stop = start + unit;
      if (take[u] == unit && dst == nullptr && layout.row_map == nullptr) {
        written += unit;
        continue;
      }
      if (take[u] == 0 && start >= sink_tokens && stop <= n - recent_tokens) continue;
      int64_t left = take[u];
      for (int64_t t = start; t < stop; ++t) {
        if (!present(b, h, t)) continue;
        const bool window = t < sink_tokens || t >= n - recent_tokens;
        if (left > 0 || window) put(t);
        left -= left > 0;
      }
    }
    for (int64_t t = complete * unit; t < n; ++t) {
      const bool window = t < sink_tokens || t >= n - recent_tokens;
      if (present(b, h, t) && (t >= n - own_of_row[b] || window)) put(t);
    }
    return written;
  };
  at::parallel_for(0, num_rows * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / num_heads, complete = lens[b] / unit;
      const float* s = scores + index * max_units;
      std::vector<int64_t>& take = taken[index];
      take.assign(complete, 0);
      const int64_t rest = rest_of_row[b];
      scratch.clear();
      for (int64_t u = 0; u < complete; ++u)
        if (s[u] != kNegInf) scratch.push_back(s[u]);
      const int64_t k = std::min<int64_t>((rest + unit - 1) / unit, scratch.size());
      if (k > 0) {
        std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(),
                         std::greater<float>());
        const float threshold = scratch[k - 1];
        int64_t ties = k, last = -1;
        for (int64_t u = 0; u < complete; ++u) ties -= s[u] > threshold;
        for (int64_t u = 0; u < complete; ++u) {
          if (s[u] > threshold || (s[u] == threshold && ties-- > 0)) take[u] = unit;
          if (take[u] && s[u] == threshold) last = u;  // the last one in rank order
        }
        // The k-th unit ranked takes what is left of the rest.
        if (rest < k * unit && last >= 0) take[last] = rest - (k - 1) * unit;
      }
      widths[index] = emit(b, index % num_heads, take, nullptr);
    }
  });
  int64_t width = 0;
  auto num_selected = at::zeros({num_rows}, at::kLong);
  int64_t* selected = num_selected.data_ptr<int64_t>();
  for (int64_t index = 0; index < num_rows * num_heads; ++index) {
    width = std::max(width, widths[index]);
    selected[index / num_heads] = std::max(selected[index / num_heads], widths[index]);
  }
  auto positions = at::full({num_rows, num_heads, width}, -1, at::kInt);
  int32_t* pos = positions.data_ptr<int32_t>();
  at::parallel_for(0, num_rows * num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index)
      emit(index / num_heads, index % num_heads, taken[index], pos + index * width);
  });
  return {positions, num_selected};
}

}  // namespace infinigen

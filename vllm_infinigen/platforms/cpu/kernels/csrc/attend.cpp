// SPDX-License-Identifier: Apache-2.0
// Attention of a sparse layer over its pool, read in place: decode rows over
// the selected positions (or, in dense mode, every position), prefill rows
// causally over the request's whole context.
#include "ops.h"

namespace infinigen {
namespace {

constexpr int64_t kChunk = 16;  // rows per online-softmax update
constexpr int64_t kMaxGroup = 64;  // query heads per KV head
constexpr int64_t kGroupTile = 8;  // query heads kept in registers at once
// Rows ahead of the one being read whose K|V lines are prefetched, one row per
// row read: a whole chunk's rows prefetched at once (as before) stalled the
// kernel on the prefetches themselves (the line-fill buffers full, most
// rows on pages the TLB misses); 4-8 rows ahead measured best, 16 and more
// worse than none.
constexpr int64_t kPrefetchRows = 8;

static_assert(kChunk % kVecSize == 0, "a chunk's weights are whole vectors");

// logits[r] = the sum of acc[r]'s lanes, for the kChunk rows of a chunk.
//
// One reduce_add per (row, query head) costs as many shuffles as the row's
// FMAs; reducing the chunk's accumulators together, as a transpose in which
// every step adds two half-reduced vectors, takes about a third of them and
// leaves the logits in one vector per kVecSize rows.
inline void sum_lanes_of_rows(const fVec* acc, float* logits) {
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(kVecSize == 16 && kChunk == 16, "a 16 x 16 reduction");
  // Pairs (a, b): per 128-bit lane, [a0+a2, b0+b2, a1+a3, b1+b3].
  __m512 pairs[8];
  for (int p = 0; p < 8; ++p) {
    const __m512 a = acc[2 * p], b = acc[2 * p + 1];
    pairs[p] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  // Quads: per 128-bit lane, rows 4q..4q+3 each summed over the lane.
  __m512 quads[4];
  for (int q = 0; q < 4; ++q) {
    const __m512d a = _mm512_castps_pd(pairs[2 * q]), b = _mm512_castps_pd(pairs[2 * q + 1]);
    quads[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Across the four 128-bit lanes: 0x88 takes lanes 0 and 2 of each source, 0xDD lanes 1 and 3.
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  _mm512_storeu_ps(logits, _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88),
                                         _mm512_shuffle_f32x4(lo, hi, 0xDD)));
#elif defined(CPU_CAPABILITY_AVX2)
  static_assert(kVecSize == 8 && kChunk % 8 == 0, "8 x 8 reductions");
  for (int64_t base = 0; base < kChunk; base += 8) {
    const fVec* rows = acc + base;
    __m256 pairs[4];
    for (int p = 0; p < 4; ++p) {
      const __m256 a = rows[2 * p], b = rows[2 * p + 1];
      pairs[p] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    }
    __m256 quads[2];
    for (int q = 0; q < 2; ++q) {
      const __m256d a = _mm256_castps_pd(pairs[2 * q]), b = _mm256_castps_pd(pairs[2 * q + 1]);
      quads[q] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                               _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    // [rows 0-3 | rows 4-7], each the sum of its two 128-bit halves.
    _mm256_storeu_ps(logits + base,
                     _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                                   _mm256_permute2f128_ps(quads[0], quads[1], 0x31)));
  }
#else
  for (int64_t r = 0; r < kChunk; ++r) logits[r] = sum_lanes(acc[r]);
#endif
}

// Online-softmax attention of `group` queries (scale folded in, float [group, D])
// over `count` K|V rows (K at rows[i], V at rows[i] + D). Writes the normalised
// output to out [group, D]; with `logits` ([group, count]), also keeps each
// row's logit and returns the running max / sum so that probabilities can be
// formed afterwards.
//
// kGroup > 0 fixes the group size at compile time (1, 2, 4, 8: the common GQA
// ratios), so that the tile loops unroll and the accumulators stay in registers.
template <typename T, int64_t kGroup>
void attend_rows(const T* const* rows, int64_t count, const float* query, int64_t dyn_group,
                 int64_t head_size, float* out, float* logits, float* max_out,
                 float* sum_out) {
  const int64_t group = kGroup > 0 ? kGroup : dyn_group;
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  alignas(64) float weights[kMaxGroup][kChunk];
  // A tile's accumulators of the chunk's rows, before their lanes are summed.
  fVec partial[kGroupTile][kChunk];
  for (int64_t g = 0; g < group; ++g) {
    running_max[g] = kNegInf;
    running_sum[g] = 0.f;
    std::fill(out + g * head_size, out + (g + 1) * head_size, 0.f);
  }
  const int64_t full = head_size - head_size % kVecSize;
  const int64_t row_bytes = 2 * head_size * static_cast<int64_t>(sizeof(T));
  for (int64_t begin = 0; begin < count; begin += kChunk) {
    const int64_t n = std::min(kChunk, count - begin);
    // Logits: each K row is loaded once for a tile of query heads.
    for (int64_t g0 = 0; g0 < group; g0 += kGroupTile) {
      const int64_t tile = kGroup > 0 ? kGroup : std::min(kGroupTile, group - g0);
      for (int64_t i = 0; i < n; ++i) {
        if (g0 == 0 && begin + i + kPrefetchRows < count) {
          const char* ahead = reinterpret_cast<const char*>(rows[begin + i + kPrefetchRows]);
          for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(ahead + byte);
        }
        const T* key = rows[begin + i];
        fVec acc[kGroupTile];
        for (int64_t g = 0; g < tile; ++g) acc[g] = fVec(0.f);
        int64_t d = 0;
        for (; d < full; d += kVecSize) {
          const fVec k = load_float(key + d);
          for (int64_t g = 0; g < tile; ++g)
            acc[g] = at::vec::fmadd(fVec::loadu(query + (g0 + g) * head_size + d), k, acc[g]);
        }
        if (d < head_size) {
          const fVec k = load_float_partial(key + d, head_size - d);
          for (int64_t g = 0; g < tile; ++g)
            acc[g] = at::vec::fmadd(fVec::loadu(query + (g0 + g) * head_size + d, head_size - d),
                                    k, acc[g]);
        }
        for (int64_t g = 0; g < tile; ++g) partial[g][i] = acc[g];
      }
      for (int64_t g = 0; g < tile; ++g) {
        for (int64_t i = n; i < kChunk; ++i) partial[g][i] = fVec(0.f);
        sum_lanes_of_rows(partial[g], weights[g0 + g]);
      }
    }
    // Online softmax, a chunk's weights as whole vectors: rescale once per chunk.
    for (int64_t g = 0; g < group; ++g) {
      float* w = weights[g];
      if (logits != nullptr) {
        // Whole vectors (std::copy of a few floats becomes a slow `rep movs`).
        float* dst = logits + g * count + begin;
        int64_t i = 0;
        for (; i + kVecSize <= n; i += kVecSize) fVec::loadu(w + i).store(dst + i);
        if (i < n) fVec::loadu(w + i).store(dst + i, n - i);
      }
      for (int64_t i = n; i < kChunk; ++i) w[i] = kNegInf;
      fVec top_lanes = fVec::loadu(w);
      for (int64_t i = kVecSize; i < kChunk; i += kVecSize)
        top_lanes = at::vec::maximum(top_lanes, fVec::loadu(w + i));
      const float chunk_max = std::max(running_max[g], max_lanes(top_lanes));
      if (chunk_max > running_max[g]) {
        const float scale = std::exp(running_max[g] - chunk_max);
        const fVec correction(scale);
        running_sum[g] *= scale;
        float* o = out + g * head_size;
        int64_t d = 0;
        for (; d < full; d += kVecSize) (fVec::loadu(o + d) * correction).store(o + d);
        for (; d < head_size; ++d) o[d] *= scale;
        running_max[g] = chunk_max;
      }
      const fVec top(chunk_max);
      fVec sum(0.f);
      for (int64_t i = 0; i < kChunk; i += kVecSize) {
        const fVec e = (fVec::loadu(w + i) - top).exp_u20();
        e.store(w + i);
        sum = sum + e;
      }
      running_sum[g] += sum_lanes(sum);
    }
    // Values: accumulators of a tile of query heads stay in registers over the chunk.
    for (int64_t d = 0; d < full; d += kVecSize) {
      for (int64_t g0 = 0; g0 < group; g0 += kGroupTile) {
        const int64_t tile = kGroup > 0 ? kGroup : std::min(kGroupTile, group - g0);
        fVec acc[kGroupTile];
        for (int64_t g = 0; g < tile; ++g) acc[g] = fVec::loadu(out + (g0 + g) * head_size + d);
        for (int64_t i = 0; i < n; ++i) {
          const fVec v = load_float(rows[begin + i] + head_size + d);
          for (int64_t g = 0; g < tile; ++g)
            acc[g] = at::vec::fmadd(fVec(weights[g0 + g][i]), v, acc[g]);
        }
        for (int64_t g = 0; g < tile; ++g) acc[g].store(out + (g0 + g) * head_size + d);
      }
    }
    for (int64_t d = full; d < head_size; ++d) {
      for (int64_t i = 0; i < n; ++i) {
        const float v = static_cast<float>(rows[begin + i][head_size + d]);
        for (int64_t g = 0; g < group; ++g) out[g * head_size + d] += weights[g][i] * v;
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = running_sum[g] > 0.f ? 1.f / running_sum[g] : 0.f;
    float* o = out + g * head_size;
    for (int64_t d = 0; d < head_size; ++d) o[d] *= inv;
    if (max_out != nullptr) {
      max_out[g] = running_max[g];
      sum_out[g] = running_sum[g];
    }
  }
}

void check_query_rows(const at::Tensor& query, const at::Tensor& kv_pool) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [rows, H_q, D], last dim contiguous");
  TORCH_CHECK(query.scalar_type() == kv_pool.scalar_type() || kv_pool.element_size() == 1,
              "query and kv_pool: one dtype, or an FP8 pool");
  TORCH_CHECK(kv_pool.size(3) == 2 * query.size(2), "kv_pool rows must be 2 * head size");
  TORCH_CHECK(query.size(1) % kv_pool.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(1) / kv_pool.size(1) <= kMaxGroup, "at most ", kMaxGroup,
              " query heads per KV head");
}

}  // namespace

at::Tensor attend_decode(const at::Tensor& query, const at::Tensor& kv_pool,
                         const at::Tensor& block_table, const at::Tensor& context_lens,
                         const std::optional<at::Tensor>& positions,
                         const std::optional<at::Tensor>& row_map, double scale,
                         const std::optional<at::Tensor>& probs,
                         const std::optional<at::Tensor>& stats, double key_scale,
                         double value_scale) {
  check_query_rows(query, kv_pool);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table: int32 [B, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(),
              "context_lens: contiguous int64 [B]");
  const PoolLayout layout = pool_layout(kv_pool, row_map);
  const int64_t num_rows = query.size(0), num_q_heads = query.size(1);
  const int64_t head_size = query.size(2), num_heads = layout.num_heads;
  const int64_t group = num_q_heads / num_heads, block_size = layout.block_size;
  const bool dense = !positions.has_value();
  int64_t width = 0;
  const int32_t* selected = nullptr;
  if (!dense) {
    TORCH_CHECK(positions->scalar_type() == at::kInt && positions->is_contiguous() &&
                    positions->dim() == 3 && positions->size(0) == num_rows &&
                    positions->size(1) == num_heads,
                "positions: contiguous int32 [B, H_kv, K] (-1: none)");
    width = positions->size(2);
    selected = positions->data_ptr<int32_t>();
  }
  float* probs_out = nullptr;
  if (probs.has_value()) {
    TORCH_CHECK(!dense && probs->scalar_type() == at::kFloat && probs->is_contiguous() &&
                    probs->numel() == num_rows * num_heads * width,
                "probs: float32 [B, H_kv, K] beside positions");
    probs_out = probs->data_ptr<float>();
  }
  double* stats_out = nullptr;
  if (stats.has_value()) {
    TORCH_CHECK(stats->scalar_type() == at::kDouble && stats->numel() == 2 &&
                    stats->is_contiguous(), "stats: float64 [2]");
    stats_out = stats->data_ptr<double>();
  }
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  auto output = at::empty({num_rows, num_q_heads, head_size}, query.options());
  std::vector<int64_t> entries(num_rows * num_heads, 0);
  // The pool's K and V over key_scale and value_scale: the first folds into the query.
  const float logit_scale = static_cast<float>(scale * key_scale);
  const float output_scale = static_cast<float>(value_scale);

  INFINIGEN_DISPATCH_POOL_QUERY(kv_pool.scalar_type(), query.scalar_type(), "attend_decode", [&] {
    const scalar_t* pool = kv_pool.data_ptr<scalar_t>();
    const query_t* query_data = query.data_ptr<query_t>();
    query_t* out_data = output.data_ptr<query_t>();
    at::parallel_for(0, num_rows * num_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<const scalar_t*> rows;
      std::vector<int64_t> row_index;  // index into positions, for probs
      std::vector<float> q(group * head_size), acc(group * head_size), logits;
      float max_g[kMaxGroup], sum_g[kMaxGroup];
      for (int64_t index = begin; index < end; ++index) {
        const int64_t b = index / num_heads, h = index % num_heads, n = lens[b];
        const int32_t* blocks = table + b * table_stride;
        auto row_at = [&](int64_t position) -> const scalar_t* {
          const int64_t entry =
              layout.entry(blocks[position / block_size], h, position % block_size);
          return entry < 0 ? nullptr : pool + entry;
        };
        rows.clear();
        row_index.clear();
        if (dense && layout.row_map == nullptr) {
          // Uncapped: runs of rows per block, no per-position lookup.
          for (int64_t start = 0; start < n; start += block_size) {
            const scalar_t* base = pool + layout.entry(blocks[start / block_size], h, 0);
            const int64_t run = std::min(block_size, n - start);
            for (int64_t offset = 0; offset < run; ++offset)
              rows.push_back(base + offset * layout.row_elems);
          }
        } else if (dense) {
          for (int64_t p = 0; p < n; ++p)
            if (const scalar_t* row = row_at(p)) rows.push_back(row);
        } else {
          const int32_t* sel = selected + index * width;
          for (int64_t i = 0; i < width; ++i) {
            if (sel[i] < 0) continue;
            if (const scalar_t* row = row_at(sel[i])) {
              rows.push_back(row);
              row_index.push_back(i);
            }
          }
        }
        entries[index] = static_cast<int64_t>(rows.size());
        const scalar_t* current = row_at(n);
        TORCH_CHECK(current != nullptr, "the current token's entry is not in the pool");
        rows.push_back(current);
        const query_t* qrow = query_data + b * query.stride(0) + h * group * query.stride(1);
        for (int64_t g = 0; g < group; ++g)
          for (int64_t d = 0; d < head_size; ++d)
            q[g * head_size + d] =
                static_cast<float>(qrow[g * query.stride(1) + d]) * logit_scale;
        const int64_t count = static_cast<int64_t>(rows.size());
        if (probs_out != nullptr) logits.resize(group * count);
        float* logit_rows = probs_out ? logits.data() : nullptr;
        switch (group) {
          case 1:
            attend_rows<scalar_t, 1>(rows.data(), count, q.data(), group, head_size, acc.data(),
                                     logit_rows, max_g, sum_g);
            break;
          case 2:
            attend_rows<scalar_t, 2>(rows.data(), count, q.data(), group, head_size, acc.data(),
                                     logit_rows, max_g, sum_g);
            break;
          case 4:
            attend_rows<scalar_t, 4>(rows.data(), count, q.data(), group, head_size, acc.data(),
                                     logit_rows, max_g, sum_g);
            break;
          case 8:
            attend_rows<scalar_t, 8>(rows.data(), count, q.data(), group, head_size, acc.data(),
                                     logit_rows, max_g, sum_g);
            break;
          default:
            attend_rows<scalar_t, 0>(rows.data(), count, q.data(), group, head_size, acc.data(),
                                     logit_rows, max_g, sum_g);
        }
        query_t* o = out_data + (b * num_q_heads + h * group) * head_size;
        for (int64_t i = 0; i < group * head_size; ++i)
          o[i] = static_cast<query_t>(acc[i] * output_scale);
        if (probs_out != nullptr) {
          // Each selected row's probability summed over the group, a vector of
          // rows at a time (a scalar exp per (row, query head) costs about as
          // much as the attention itself), into the first logits row (each
          // vector after it is read), then scattered to the rows' positions.
          float* p = probs_out + index * width;
          std::fill(p, p + width, 0.f);
          const int64_t selected_rows = count - 1;  // the last row is the current token
          float* total = logits.data();
          int64_t i = 0;
          for (; i + kVecSize <= selected_rows; i += kVecSize) {
            fVec sum(0.f);
            for (int64_t g = 0; g < group; ++g) {
              const fVec logit = fVec::loadu(logits.data() + g * count + i);
              sum = at::vec::fmadd((logit - fVec(max_g[g])).exp(), fVec(1.f / sum_g[g]), sum);
            }
            sum.store(total + i);
          }
          for (; i < selected_rows; ++i) {
            float sum = 0.f;
            for (int64_t g = 0; g < group; ++g)
              sum += std::exp(logits[g * count + i] - max_g[g]) / sum_g[g];
            total[i] = sum;
          }
          for (int64_t r = 0; r < selected_rows; ++r) p[row_index[r]] = total[r];
        }
      }
    });
  });
  if (stats_out != nullptr) {
    int64_t total = 0, context = 0;
    for (int64_t e : entries) total += e;
    for (int64_t b = 0; b < num_rows; ++b) context += lens[b];
    stats_out[0] += static_cast<double>(total);
    stats_out[1] += static_cast<double>(context);
  }
  return output;
}

}  // namespace infinigen

// SPDX-License-Identifier: Apache-2.0
// InfiniGen's speculative selection: scores from the partial keys, the alpha
// count, and each KV head's top-k positions (ascending), sized by the count
// actually selected.
#include <cstring>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "ops.h"

namespace infinigen {
namespace {

constexpr int64_t kGroupTile = 8;  // query heads kept in registers at once

// Order-preserving map of a float to an unsigned key (larger float, larger key).
inline uint32_t order_key(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The largest of s[0, n) (-inf when n is 0).
inline float max_of(const float* s, int64_t n) {
  float best = kNegInf;
  int64_t t = 0;
  if (n >= kVecSize) {
    fVec lanes(kNegInf);
    for (; t + kVecSize <= n; t += kVecSize) lanes = at::vec::maximum(lanes, fVec::loadu(s + t));
    alignas(64) float values[kVecSize];
    lanes.store(values);
    for (int64_t i = 0; i < kVecSize; ++i) best = std::max(best, values[i]);
  }
  for (; t < n; ++t) best = std::max(best, s[t]);
  return best;
}

// How many of s[0, n) are above `limit` (kAbove) or equal to it (kEqual).
// Lanes count in floats: exact up to 2^24 per lane, far beyond any context.
enum class Compare { kAbove, kEqual };
template <Compare kHow>
inline int64_t count_of(const float* s, int64_t n, float limit) {
  const fVec bound(limit);
  fVec lanes(0.f);
  int64_t t = 0;
  for (; t + kVecSize <= n; t += kVecSize) {
    const fVec v = fVec::loadu(s + t);
    lanes = lanes + (kHow == Compare::kAbove ? v.gt(bound) : v.eq(bound));  // 1 or 0
  }
  int64_t count = static_cast<int64_t>(sum_lanes(lanes));
  for (; t < n; ++t) count += kHow == Compare::kAbove ? s[t] > limit : s[t] == limit;
  return count;
}

// Writes to dst the positions t < n with s[t] > threshold, and the first
// `ties` with s[t] == threshold, ascending.
inline void take_top(const float* s, int64_t n, float threshold, int64_t ties,
                        int32_t* dst) {
  int64_t written = 0, t = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  const __m256 bound = _mm256_set1_ps(threshold);
  for (; t + 8 <= n; t += 8) {  // most groups of 8 hold none: one compare skips them
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + t), bound, _CMP_GE_OQ));
    while (mask) {
      const int lane = __builtin_ctz(mask);
      mask &= mask - 1;
      if (s[t + lane] > threshold || ties-- > 0) dst[written++] = static_cast<int32_t>(t + lane);
    }
  }
#endif
  for (; t < n; ++t)
    if (s[t] > threshold || (s[t] == threshold && ties-- > 0))
      dst[written++] = static_cast<int32_t>(t);
}

// The k-th largest of the scores above -inf (1 <= k <= their number).
float kth_largest(const float* scores, int64_t num_tokens, int64_t k,
                  std::vector<float>& scratch) {
  // A 2048-bin histogram of the keys' top 11 bits finds the bin holding the
  // k-th largest; nth_element runs inside that bin only.
  uint32_t histogram[2048] = {0};
  for (int64_t t = 0; t < num_tokens; ++t) histogram[order_key(scores[t]) >> 21]++;
  int64_t above = 0, bin = 2047;
  for (; bin > 0; --bin) {
    if (above + histogram[bin] >= static_cast<uint64_t>(k)) break;
    above += histogram[bin];
  }
  scratch.clear();
  for (int64_t t = 0; t < num_tokens; ++t)
    if ((order_key(scores[t]) >> 21) == static_cast<uint32_t>(bin)) scratch.push_back(scores[t]);
  const int64_t rank = k - above;  // 1-based rank inside the bin
  std::nth_element(scratch.begin(), scratch.begin() + (rank - 1), scratch.end(),
                   std::greater<float>());
  return scratch[rank - 1];
}

// Scores of one block of `count` tokens for every head:
// scores[h][t] = scale * max_g sum_r query[h, g, r] * page[h, r, t].
template <typename T>
void score_block(const float* query, const T* page, int64_t num_heads, int64_t group,
                 int64_t rank, int64_t block_size, int64_t count, float scale,
                 const int32_t* present_rows, float* const* out) {
  alignas(64) float tmp[kVecSize];
  for (int64_t h = 0; h < num_heads; ++h) {
    const T* head_page = page + h * rank * block_size;
    const float* head_query = query + h * group * rank;
    float* dst = out[h];
    for (int64_t t = 0; t < count; t += kVecSize) {
      // A page row is loaded once for every query head of the group.
      fVec best(kNegInf);
      for (int64_t g0 = 0; g0 < group; g0 += kGroupTile) {
        const int64_t tile = std::min(kGroupTile, group - g0);
        fVec acc[kGroupTile];
        for (int64_t g = 0; g < tile; ++g) acc[g] = fVec(0.f);
        for (int64_t r = 0; r < rank; ++r) {
          const fVec keys = load_float(head_page + r * block_size + t);
          for (int64_t g = 0; g < tile; ++g)
            acc[g] = at::vec::fmadd(fVec(head_query[(g0 + g) * rank + r]), keys, acc[g]);
        }
        for (int64_t g = 0; g < tile; ++g) best = at::vec::maximum(best, acc[g]);
      }
      best = best * fVec(scale);
      const int64_t n = std::min<int64_t>(kVecSize, count - t);
      if (n == kVecSize) {
        best.store(dst + t);
      } else {
        best.store(tmp);
        std::copy(tmp, tmp + n, dst + t);
      }
    }
    if (present_rows != nullptr) {
      const int32_t* rows = present_rows + h * block_size;
      for (int64_t t = 0; t < count; ++t)
        if (rows[t] < 0) dst[t] = kNegInf;
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> select_tokens(
    const at::Tensor& partial_query, const at::Tensor& partial_keys,
    const at::Tensor& block_table, const at::Tensor& context_lens, const at::Tensor& token_caps,
    double scale, double alpha, int64_t sink_tokens, int64_t recent_tokens,
    const std::optional<at::Tensor>& row_map) {
  TORCH_CHECK(partial_query.scalar_type() == at::kFloat && partial_query.is_contiguous() &&
                  partial_query.dim() == 4,
              "partial_query: contiguous float32 [B, H_kv, G, R]");
  TORCH_CHECK(partial_keys.is_contiguous() && partial_keys.dim() == 4,
              "partial_keys: contiguous [num_blocks, H_kv, R, block_size]");
  check_selection_rows(block_table, context_lens, token_caps);
  const int64_t num_rows = partial_query.size(0), num_heads = partial_query.size(1);
  const int64_t group = partial_query.size(2), rank = partial_query.size(3);
  const int64_t block_size = partial_keys.size(3);
  TORCH_CHECK(partial_keys.size(1) == num_heads && partial_keys.size(2) == rank,
              "partial_keys do not match partial_query");
  TORCH_CHECK(block_size % kVecSize == 0, "block size must be a multiple of ", kVecSize);
  const int32_t* map = nullptr;
  if (row_map.has_value()) {
    TORCH_CHECK(row_map->scalar_type() == at::kInt && row_map->is_contiguous() &&
                    row_map->size(1) == num_heads && row_map->size(2) == block_size,
                "row_map: contiguous int32 [num_blocks, H_kv, block_size]");
    map = row_map->data_ptr<int32_t>();
  }
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* caps = token_caps.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  int64_t max_len = 0;
  for (int64_t b = 0; b < num_rows; ++b) max_len = std::max(max_len, lens[b]);
  const int64_t num_blocks_max = (max_len + block_size - 1) / block_size;
  // scores: [B, H_kv, max_len], reused across calls by this thread.
  static thread_local std::vector<float> score_buffer;
  float* scores = scratch_floats(score_buffer, num_rows * num_heads * max_len);
  const float* query = partial_query.data_ptr<float>();
  const float scale_f = static_cast<float>(scale);

  // Pass 1: scores, block by block (all heads of a block page together).
  INFINIGEN_DISPATCH_KV(partial_keys.scalar_type(), "select_tokens", [&] {
    const scalar_t* pages = partial_keys.data_ptr<scalar_t>();
    at::parallel_for(0, num_rows * num_blocks_max, 1, [&](int64_t begin, int64_t end) {
      std::vector<float*> out(num_heads);
      for (int64_t index = begin; index < end; ++index) {
        const int64_t b = index / num_blocks_max, j = index % num_blocks_max;
        const int64_t start = j * block_size;
        if (start >= lens[b]) continue;
        const int64_t count = std::min(block_size, lens[b] - start);
        const int64_t block_id = table[b * table_stride + j];
        for (int64_t h = 0; h < num_heads; ++h)
          out[h] = scores + (b * num_heads + h) * max_len + start;
        const int32_t* present =
            map == nullptr ? nullptr : map + block_id * num_heads * block_size;
        score_block(query + b * num_heads * group * rank,
                    pages + block_id * num_heads * rank * block_size, num_heads, group, rank,
                    block_size, count, scale_f, present, out.data());
      }
    });
  });

  return select_from_scores(scores, lens, caps, num_rows, num_heads, max_len, alpha,
                            sink_tokens, recent_tokens);
}

void check_selection_rows(const at::Tensor& block_table, const at::Tensor& context_lens,
                          const at::Tensor& token_caps) {
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.stride(1) == 1,
              "block_table: int32 [B, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(),
              "context_lens: contiguous int64 [B]");
  TORCH_CHECK(token_caps.scalar_type() == at::kLong && token_caps.is_contiguous() &&
                  token_caps.numel() == context_lens.numel(),
              "token_caps: contiguous int64 [B]");
}

// Passes 2 and 3 of a selection, shared by every form of speculation keys:
// each head's best score and alpha count; per request k = min(floor(mean
// count over heads), the budget in tokens (token_caps, step_plan.token_budget))
// plus the sink/recent window, at most the context; each head's top-k (window
// first), ascending positions, -1 padded. scores: [B, H_kv, max_len] (-inf:
// absent), changed in place.
std::tuple<at::Tensor, at::Tensor> select_from_scores(float* scores, const int64_t* lens,
                                                      const int64_t* caps, int64_t num_rows,
                                                      int64_t num_heads, int64_t max_len,
                                                      double alpha, int64_t sink_tokens,
                                                      int64_t recent_tokens) {
  std::vector<int64_t> counts(num_rows * num_heads);
  at::parallel_for(0, num_rows * num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t n = lens[index / num_heads];
      const float* s = scores + index * max_len;
      const float limit = max_of(s, n) - static_cast<float>(alpha);
      counts[index] = count_of<Compare::kAbove>(s, n, limit);
    }
  });

  auto num_selected = at::empty({num_rows}, at::kLong);
  int64_t* selected = num_selected.data_ptr<int64_t>();
  int64_t width = 0;
  for (int64_t b = 0; b < num_rows; ++b) {
    const int64_t n = lens[b];
    int64_t total = 0;
    for (int64_t h = 0; h < num_heads; ++h) total += counts[b * num_heads + h];
    const int64_t mean = static_cast<int64_t>(
        std::floor(static_cast<double>(total) / static_cast<double>(num_heads)));
    const int64_t cap = caps[b];
    int64_t window = 0;
    for (int64_t t = 0; t < n; ++t) window += (t < sink_tokens || t >= n - recent_tokens);
    selected[b] = std::min(std::min(mean, cap) + window, n);
    width = std::max(width, selected[b]);
  }

  // Pass 3: each head's top-k (window first), ascending positions, -1 padded.
  auto positions = at::full({num_rows, num_heads, width}, -1, at::kInt);
  int32_t* pos = positions.data_ptr<int32_t>();
  at::parallel_for(0, num_rows * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / num_heads, n = lens[b];
      float* s = scores + index * max_len;
      int32_t* dst = pos + index * width;
      // The window first (absent tokens, -inf, are never selected, window or not).
      for (int64_t t = 0; t < std::min(sink_tokens, n); ++t)
        if (s[t] != kNegInf) s[t] = kPosInf;
      for (int64_t t = std::max<int64_t>(n - recent_tokens, 0); t < n; ++t)
        if (s[t] != kNegInf) s[t] = kPosInf;
      const int64_t candidates = n - count_of<Compare::kEqual>(s, n, kNegInf);
      const int64_t k = std::min(selected[b], candidates);
      if (k == 0) continue;
      int64_t written = 0;
      if (k == candidates) {
        for (int64_t t = 0; t < n; ++t)
          if (s[t] != kNegInf) dst[written++] = static_cast<int32_t>(t);
        continue;
      }
      const float threshold = kth_largest(s, n, k, scratch);
      // Ties at the threshold are taken in position order.
      take_top(s, n, threshold, k - count_of<Compare::kAbove>(s, n, threshold), dst);
    }
  });
  return {positions, num_selected};
}

}  // namespace infinigen

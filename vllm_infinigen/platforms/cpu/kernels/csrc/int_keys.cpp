// SPDX-License-Identifier: Apache-2.0
// Integer speculation keys: every key channel, `bits` bits per token, one
// float16 scale per channel and 16-token group (per KV head).
//
//   codes   [num_blocks, H_kv, G, D, 2 * bits] uint8  G = block_size / 16 groups;
//           row c of a group holds channel c of its 16 tokens, token t in bits
//           [bits * t, bits * t + bits) of the row read as a little-endian word
//   scales  [num_blocks, H_kv, G, D] float16  s[c] = max_t |k[t, c]| / half,
//           half = (2^bits - 1) / 2, and k[t, c] ~= (code - half) * s[c]
//
// A group is encoded when its 16th token is written (from the keys in the
// pool); a row whose context ends inside a group scores that open group's
// tokens from the full keys in the pool.
#include <cstring>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "int_keys_avx512.h"  // Spread, query_group_scores_avx512 (AVX-512 builds)
#include "ops.h"

namespace infinigen {
namespace {

constexpr int64_t kGroupTokens = kKeyGroupTokens;
static_assert(kGroupTokens % kVecSize == 0, "a group is whole vectors");
constexpr int64_t kGroupVecs = kGroupTokens / kVecSize;

inline float half_range(int64_t bits) { return 0.5f * static_cast<float>((1 << bits) - 1); }

// One channel's 16 codes of a group as floats, in "phase-major" order: with
// P = 8 / bits codes per byte and L = 2 * bits bytes, position k = p * L + i
// holds the code of token i * P + p (byte i, bits [bits * p, bits * p + bits)).
// Constant bits let the compiler vectorize it; ``token_of`` maps back.
template <int kBits>
inline void unpack_phase_major(const uint8_t* row, float* out) {
  constexpr int kPhases = 8 / kBits, kBytes = 2 * kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  for (int p = 0; p < kPhases; ++p)
    for (int i = 0; i < kBytes; ++i)
      out[p * kBytes + i] = static_cast<float>((static_cast<uint32_t>(row[i]) >> (kBits * p)) & kMask);
}

// Token of phase-major position k (``unpack_phase_major``); identity when bits
// do not divide 8 (the generic unpack keeps token order).
inline int64_t token_of(int64_t k, int64_t bits) {
  if (8 % bits != 0) return k;
  const int64_t bytes = 2 * bits, phases = 8 / bits;
  return (k % bytes) * phases + k / bytes;
}

#if defined(CPU_CAPABILITY_AVX2)
// A 4- or 2-bit row's positions 0-7 (low) and 8-15 (high) as floats, in
// registers; false for other bits. (AVX-512 builds score through ``Spread``.)
inline bool unpack_registers(const uint8_t* row, int64_t bits, __m256& low, __m256& high) {
  if (bits == 4) {  // 8 bytes: low nibbles are positions 0-7, high nibbles 8-15
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row)));
    low = _mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(15)));
    high = _mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));
    return true;
  }
  if (bits == 2) {  // 4 bytes, 4 phases of 4 positions
    int32_t word;
    std::memcpy(&word, row, 4);
    const __m128i wide = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(word));
    const __m256i mask = _mm256_set1_epi32(3);
    low = _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi32(wide, 2), wide), mask));
    high = _mm256_cvtepi32_ps(_mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi32(wide, 6), _mm_srli_epi32(wide, 4)), mask));
    return true;
  }
  return false;
}
#endif

inline void unpack_codes(const uint8_t* row, int64_t bits, float* out) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256 low, high;
  if (unpack_registers(row, bits, low, high)) {
    _mm256_storeu_ps(out, low);
    _mm256_storeu_ps(out + 8, high);
    return;
  }
#endif
  switch (bits) {
    case 4: return unpack_phase_major<4>(row, out);
    case 2: return unpack_phase_major<2>(row, out);
    case 1: return unpack_phase_major<1>(row, out);
    default: {
      uint64_t word = 0;
      std::memcpy(&word, row, 2 * bits);
      const uint64_t mask = (uint64_t{1} << bits) - 1;
      for (int64_t t = 0; t < kGroupTokens; ++t)
        out[t] = static_cast<float>((word >> (bits * t)) & mask);
    }
  }
}

// best[k] = max over query heads g0 .. g0 + kG of sum_d weights[g, d] *
// code[d, k] - offsets[g], for the 16 unpacked positions k of one group:
// each channel's codes are unpacked once and feed kG query heads'
// accumulators in registers.
template <int kG>
inline void group_scores(const uint8_t* rows, int64_t bits, int64_t head_size,
                         const float* weights, const float* offsets, int64_t g0,
                         fVec (&best)[kGroupVecs]) {
  fVec acc[kG][kGroupVecs];
  for (int i = 0; i < kG; ++i)
    for (int64_t v = 0; v < kGroupVecs; ++v) acc[i][v] = fVec(0.f);
  alignas(64) float codes[kGroupTokens];
  for (int64_t d = 0; d < head_size; ++d) {
    fVec unpacked[kGroupVecs];
#if defined(CPU_CAPABILITY_AVX2)  // two 8-lane vectors: the codes stay in registers
    __m256 low, high;
    if (unpack_registers(rows + d * 2 * bits, bits, low, high)) {
      unpacked[0] = fVec(low);
      unpacked[1] = fVec(high);
    } else
#endif
    {
      unpack_codes(rows + d * 2 * bits, bits, codes);
      for (int64_t v = 0; v < kGroupVecs; ++v) unpacked[v] = fVec::loadu(codes + v * kVecSize);
    }
    for (int i = 0; i < kG; ++i) {
      const fVec weight(weights[(g0 + i) * head_size + d]);
      for (int64_t v = 0; v < kGroupVecs; ++v)
        acc[i][v] = at::vec::fmadd(weight, unpacked[v], acc[i][v]);
    }
  }
  for (int i = 0; i < kG; ++i) {
    const fVec offset(offsets[g0 + i]);
    for (int64_t v = 0; v < kGroupVecs; ++v)
      best[v] = at::vec::maximum(best[v], acc[i][v] - offset);
  }
}

// best = max over all query_group heads of the group's 16 scores (positions
// as ``unpack_codes``'s), query heads taken 4, 2 and 1 at a time.
inline void score_group(const uint8_t* rows, int64_t bits, int64_t head_size,
                        const float* weights, const float* offsets, int64_t query_group,
                        fVec (&best)[kGroupVecs]) {
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(kGroupVecs == 1, "one 16-lane vector per group");
  __m512 top = best[0];
  switch (bits) {
    case 4: query_group_scores_avx512<4>(rows, head_size, weights, offsets, query_group, top); break;
    case 3: query_group_scores_avx512<3>(rows, head_size, weights, offsets, query_group, top); break;
    case 2: query_group_scores_avx512<2>(rows, head_size, weights, offsets, query_group, top); break;
    default: query_group_scores_avx512<1>(rows, head_size, weights, offsets, query_group, top);
  }
  best[0] = fVec(top);
#else
  int64_t g = 0;
  for (; g + 4 <= query_group; g += 4)
    group_scores<4>(rows, bits, head_size, weights, offsets, g, best);
  for (; g + 2 <= query_group; g += 2)
    group_scores<2>(rows, bits, head_size, weights, offsets, g, best);
  for (; g < query_group; ++g)
    group_scores<1>(rows, bits, head_size, weights, offsets, g, best);
#endif
}

}  // namespace

void write_int_keys(at::Tensor& codes, at::Tensor& scales, const at::Tensor& kv_pool,
                    const at::Tensor& slot_mapping, const std::optional<at::Tensor>& row_map) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 5,
              "codes: contiguous uint8 [num_blocks, H_kv, G, D, 2 * bits]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 4,
              "scales: contiguous float16 [num_blocks, H_kv, G, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping: contiguous int64");
  const int64_t num_blocks = codes.size(0), num_heads = codes.size(1);
  const int64_t groups = codes.size(2), head_size = codes.size(3);
  const int64_t bits = codes.size(4) / 2;
  TORCH_CHECK(bits >= 1 && bits <= 4 && codes.size(4) == 2 * bits, "codes: 1 to 4 bits");
  TORCH_CHECK(scales.size(0) == num_blocks && scales.size(1) == num_heads &&
                  scales.size(2) == groups && scales.size(3) == head_size,
              "scales do not match codes");
  const PoolLayout layout = pool_layout(kv_pool, row_map);
  const int64_t block_size = layout.block_size;
  TORCH_CHECK(block_size == groups * kGroupTokens && kv_pool.size(1) == num_heads &&
                  kv_pool.size(3) == 2 * head_size,
              "kv_pool does not match codes: [units, H_kv, 16 * G, 2 * D]");
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto closes_group = [](int64_t slot) {
    return slot >= 0 && slot % kGroupTokens == kGroupTokens - 1;
  };
  // Most decode steps close no group (1 in 16): nothing to encode, no parallel region.
  if (std::none_of(slots, slots + num_tokens, closes_group)) return;
  const float half = half_range(bits);
  const float max_code = static_cast<float>((1 << bits) - 1);
  uint8_t* code_data = codes.data_ptr<uint8_t>();
  at::Half* scale_data = scales.data_ptr<at::Half>();

  INFINIGEN_DISPATCH_POOL(kv_pool.scalar_type(), "write_int_keys", [&] {
    const scalar_t* pool = kv_pool.data_ptr<scalar_t>();
    at::parallel_for(0, num_tokens * num_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> keys(kGroupTokens * head_size);
      for (int64_t index = begin; index < end; ++index) {
        const int64_t token = index / num_heads, head = index % num_heads;
        const int64_t slot = slots[token];
        if (!closes_group(slot)) continue;
        const int64_t block_id = slot / block_size, offset = slot % block_size;
        TORCH_CHECK(block_id < num_blocks, "slot ", slot, " beyond the speculation keys");
        const int64_t group = offset / kGroupTokens, first = group * kGroupTokens;
        // keys: [16, D] of the group, zeros where a capped pool evicted an entry.
        for (int64_t t = 0; t < kGroupTokens; ++t) {
          const int64_t entry = layout.entry(block_id, head, first + t);
          float* dst = keys.data() + t * head_size;
          if (entry < 0) {
            std::fill(dst, dst + head_size, 0.f);
          } else {
            for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<float>(pool[entry + d]);
          }
        }
        const int64_t cell = (block_id * num_heads + head) * groups + group;
        at::Half* scale = scale_data + cell * head_size;
        uint8_t* rows = code_data + cell * head_size * 2 * bits;
        for (int64_t c = 0; c < head_size; ++c) {
          float largest = 0.f;
          for (int64_t t = 0; t < kGroupTokens; ++t)
            largest = std::max(largest, std::abs(keys[t * head_size + c]));
          scale[c] = static_cast<at::Half>(largest / half);
          const float step = static_cast<float>(scale[c]);  // what scoring will read
          uint64_t word = 0;
          for (int64_t t = 0; t < kGroupTokens; ++t) {
            float code = 0.f;
            if (step > 0.f)
              code = std::min(max_code, std::max(0.f, std::nearbyint(
                                                          keys[t * head_size + c] / step + half)));
            word |= static_cast<uint64_t>(code) << (bits * t);
          }
          std::memcpy(rows + c * 2 * bits, &word, 2 * bits);  // little-endian
        }
      }
    });
  });
}

std::tuple<at::Tensor, at::Tensor> select_tokens_int(
    const at::Tensor& query, const at::Tensor& codes, const at::Tensor& scales,
    const at::Tensor& kv_pool, const at::Tensor& block_table, const at::Tensor& context_lens,
    const at::Tensor& token_caps, double scale, double alpha, int64_t sink_tokens,
    int64_t recent_tokens, const std::optional<at::Tensor>& row_map) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.is_contiguous() && query.dim() == 4,
              "query: contiguous float32 [B, H_kv, G_q, D]");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 5,
              "codes: contiguous uint8 [num_blocks, H_kv, G, D, 2 * bits]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "scales: contiguous float16 [num_blocks, H_kv, G, D]");
  check_selection_rows(block_table, context_lens, token_caps);
  const int64_t num_rows = query.size(0), num_heads = query.size(1);
  const int64_t query_group = query.size(2), head_size = query.size(3);
  const int64_t groups = codes.size(2), bits = codes.size(4) / 2;
  TORCH_CHECK(codes.size(1) == num_heads && codes.size(3) == head_size,
              "codes do not match the query");
  const PoolLayout layout = pool_layout(kv_pool, row_map);
  const int64_t block_size = layout.block_size;
  TORCH_CHECK(block_size == groups * kGroupTokens, "kv_pool does not match codes");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* caps = token_caps.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  int64_t max_len = 0;
  for (int64_t b = 0; b < num_rows; ++b) max_len = std::max(max_len, lens[b]);
  const int64_t num_blocks_max = (max_len + block_size - 1) / block_size;
  static thread_local std::vector<float> score_buffer;  // [B, H_kv, max_len]
  float* scores = scratch_floats(score_buffer, num_rows * num_heads * max_len);
  const float* queries = query.data_ptr<float>();
  const uint8_t* code_data = codes.data_ptr<uint8_t>();
  const at::Half* scale_data = scales.data_ptr<at::Half>();
  const float scale_f = static_cast<float>(scale), half = half_range(bits);
  int64_t order[kGroupTokens];  // token of each unpacked position
  for (int64_t k = 0; k < kGroupTokens; ++k) order[k] = token_of(k, bits);
#if defined(CPU_CAPABILITY_AVX512)
  // The same reordering as one vpermps: lane t of the scores takes position
  // position_of[t] (the inverse of order).
  alignas(64) int32_t position_of[kGroupTokens];
  for (int64_t k = 0; k < kGroupTokens; ++k) position_of[order[k]] = static_cast<int32_t>(k);
  const __m512i to_tokens = _mm512_load_si512(position_of);
#endif

  // Pass 1: scores, group by group: complete groups from the codes, the open
  // group (the row's context ends inside it) from the full keys in the pool.
  INFINIGEN_DISPATCH_POOL(kv_pool.scalar_type(), "select_tokens_int", [&] {
    const scalar_t* pool = kv_pool.data_ptr<scalar_t>();
    at::parallel_for(0, num_rows * num_blocks_max, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> weights(query_group * head_size), offsets(query_group);
      std::vector<float> acc(kGroupTokens), step_scale(head_size);
      for (int64_t index = begin; index < end; ++index) {
        const int64_t b = index / num_blocks_max, j = index % num_blocks_max;
        const int64_t n = lens[b], start = j * block_size;
        if (start >= n) continue;
        const int64_t block_id = table[b * table_stride + j];
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* q = queries + (b * num_heads + h) * query_group * head_size;
          float* out = scores + (b * num_heads + h) * max_len;
          for (int64_t group = 0; group < groups; ++group) {
            const int64_t first = start + group * kGroupTokens;
            if (first >= n) break;
            const int64_t count = std::min(kGroupTokens, n - first);
            float* dst = out + first;
            if (count < kGroupTokens) {  // open: the full keys
              for (int64_t t = 0; t < count; ++t) {
                const int64_t entry = layout.entry(block_id, h, group * kGroupTokens + t);
                if (entry < 0) {
                  dst[t] = kNegInf;
                  continue;
                }
                float best = kNegInf;
                for (int64_t g = 0; g < query_group; ++g) {
                  float dot = 0.f;
                  for (int64_t d = 0; d < head_size; ++d)
                    dot += q[g * head_size + d] * static_cast<float>(pool[entry + d]);
                  best = std::max(best, dot);
                }
                dst[t] = best * scale_f;
              }
              continue;
            }
            const int64_t cell = (block_id * num_heads + h) * groups + group;
            const at::Half* s = scale_data + cell * head_size;
            const uint8_t* rows = code_data + cell * head_size * 2 * bits;
            int64_t c = 0;  // the group's scales as floats, once for every query head
            for (; c + kVecSize <= head_size; c += kVecSize)
              load_float<at::Half>(s + c).store(step_scale.data() + c);
            for (; c < head_size; ++c) step_scale[c] = static_cast<float>(s[c]);
            // weights [G_q, D] = query * scale; the codes' offset half folds
            // into one number per query head.
            for (int64_t g = 0; g < query_group; ++g) {
              const float* qg = q + g * head_size;
              float* w = weights.data() + g * head_size;
              fVec sums(0.f);  // vector lanes: no serial chain of additions
              int64_t d = 0;
              for (; d + kVecSize <= head_size; d += kVecSize) {
                const fVec product = fVec::loadu(qg + d) * fVec::loadu(step_scale.data() + d);
                product.store(w + d);
                sums = sums + product;
              }
              float total = sum_lanes(sums);
              for (; d < head_size; ++d) {
                w[d] = qg[d] * step_scale[d];
                total += w[d];
              }
              offsets[g] = half * total;
            }
            fVec best[kGroupVecs];
            for (int64_t v = 0; v < kGroupVecs; ++v) best[v] = fVec(kNegInf);
            score_group(rows, bits, head_size, weights.data(), offsets.data(), query_group, best);
#if defined(CPU_CAPABILITY_AVX512)
            _mm512_storeu_ps(dst, _mm512_permutexvar_ps(
                                      to_tokens, _mm512_mul_ps(best[0], _mm512_set1_ps(scale_f))));
#else
            for (int64_t v = 0; v < kGroupVecs; ++v)
              (best[v] * fVec(scale_f)).store(acc.data() + v * kVecSize);
            for (int64_t k = 0; k < kGroupTokens; ++k) dst[order[k]] = acc[k];
#endif
            if (row_map.has_value()) {  // evicted entries are never selected
              for (int64_t t = 0; t < kGroupTokens; ++t)
                if (layout.entry(block_id, h, group * kGroupTokens + t) < 0) dst[t] = kNegInf;
            }
          }
        }
      }
    });
  });
  return select_from_scores(scores, lens, caps, num_rows, num_heads, max_len, alpha,
                            sink_tokens, recent_tokens);
}

}  // namespace infinigen

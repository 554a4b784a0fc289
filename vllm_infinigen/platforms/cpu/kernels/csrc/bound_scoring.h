// SPDX-License-Identifier: Apache-2.0
// The bound keys' scoring (for bounds.cpp, which describes their layout): a
// unit's codes as floats, and its upper bound of q . k over a query group,
// one unit at a time (any shape) or two at a time (8 bits, D a multiple of
// the vector width: the default's shape).
#pragma once

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <type_traits>

#include "common.h"

namespace infinigen {
namespace bound_scoring {

// The 8-bit codes of channels [c, c + kVecSize) of a row, as floats.
inline fVec load_codes8(const uint8_t* row, int64_t c) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return fVec(_mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)))));
#else
  alignas(64) float out[kVecSize];
  for (int64_t i = 0; i < kVecSize; ++i) out[i] = row[c + i];
  return fVec::loadu(out);
#endif
}

// `count` codes of one row, channels [first, first + count), as floats (8 bits:
// bytes [first, ...); 4 bits: the low nibbles of bytes [first, ...) when first
// < D/2, else the high nibbles of bytes [first - D/2, ...)).
inline fVec load_codes(const uint8_t* row, int64_t bits, int64_t half_channels, int64_t first) {
  if (bits == 8) return load_codes8(row, first);
  const bool high = first >= half_channels;  // 4 bits
  const uint8_t* bytes = row + (high ? first - half_channels : first);
#if defined(CPU_CAPABILITY_AVX512)
  __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  wide = high ? _mm512_srli_epi32(wide, 4) : _mm512_and_si512(wide, _mm512_set1_epi32(15));
  return fVec(_mm512_cvtepi32_ps(wide));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  wide = high ? _mm256_srli_epi32(wide, 4) : _mm256_and_si256(wide, _mm256_set1_epi32(15));
  return fVec(_mm256_cvtepi32_ps(wide));
#else
  alignas(64) float out[kVecSize];
  for (int64_t i = 0; i < kVecSize; ++i)
    out[i] = high ? bytes[i] >> 4 : bytes[i] & 15;
  return fVec::loadu(out);
#endif
}

// One code of a row (channel c), for the channels past the last whole vector.
inline float code_at(const uint8_t* row, int64_t bits, int64_t half_channels, int64_t c) {
  if (bits == 8) return row[c];
  return c < half_channels ? (row[c] & 15) : (row[c - half_channels] >> 4);
}

// The widest query group one pass scores: two accumulators per query head
// (the maxima's and the minima's products, so that each chain is half as
// long) stay in registers up to 4 heads (8 of AVX2's 16 vector registers).
constexpr int64_t kGroupChunk = 4;

// Calls f(std::integral_constant<int64_t, G>{}, g) for each chunk [g, g + G)
// of a query group, G at most kGroupChunk (the bound is a maximum over the
// heads: chunks combine exactly).
template <typename F>
inline void for_each_group_chunk(int64_t query_group, F&& f) {
  for (int64_t g = 0; g < query_group; g += kGroupChunk) {
    switch (std::min(kGroupChunk, query_group - g)) {
      case 4: f(std::integral_constant<int64_t, 4>{}, g); break;
      case 3: f(std::integral_constant<int64_t, 3>{}, g); break;
      case 2: f(std::integral_constant<int64_t, 2>{}, g); break;
      default: f(std::integral_constant<int64_t, 1>{}, g);
    }
  }
}

// A unit's bound for query heads [0, G) of a KV head's group, before the
// scales: max over them of q+ . max codes + q- . min codes - offset x sum q.
// `w` holds each head's positive then negative query parts (2 D floats),
// `offs` each head's offset x sum q.
template <int64_t G>
inline float unit_bound(const uint8_t* rows, int64_t row_bytes, const float* w,
                        const float* offs, int64_t bits, int64_t head_size, int64_t segment,
                        int64_t vector_end) {
  const int64_t half = head_size / 2;
  fVec up_acc[G], down_acc[G];
  for (int64_t g = 0; g < G; ++g) up_acc[g] = down_acc[g] = fVec(0.f);
  for (int64_t base = 0; base < head_size; base += segment) {
    for (int64_t c = 0; c < vector_end; c += kVecSize) {
      // Each row's codes once for every query head.
      const fVec up = load_codes(rows, bits, half, base + c);
      const fVec down = load_codes(rows + row_bytes, bits, half, base + c);
      for (int64_t g = 0; g < G; ++g) {
        const float* wg = w + g * 2 * head_size + base + c;
        up_acc[g] = at::vec::fmadd(fVec::loadu(wg), up, up_acc[g]);
        down_acc[g] = at::vec::fmadd(fVec::loadu(wg + head_size), down, down_acc[g]);
      }
    }
  }
  float best = kNegInf;
  for (int64_t g = 0; g < G; ++g) {
    float dot = sum_lanes(up_acc[g] + down_acc[g]) - offs[g];
    const float* wg = w + g * 2 * head_size;
    for (int64_t base = 0; base < head_size; base += segment)
      for (int64_t c = base + vector_end; c < base + segment; ++c)
        dot += wg[c] * code_at(rows, bits, half, c) +
               wg[head_size + c] * code_at(rows + row_bytes, bits, half, c);
    best = std::max(best, dot);
  }
  return best;
}

// unit_bound of two units at once in 8 bits, D a multiple of kVecSize (the
// default's shape): each query vector loaded once for both units, the
// 2 x G accumulators in registers. best[i]: unit i's bound over heads [0, G).
template <int64_t G>
inline void pair_bound8(const uint8_t* rows0, const uint8_t* rows1, int64_t head_size,
                        const float* w, const float* offs, float* best) {
  fVec acc0[G], acc1[G];
  for (int64_t g = 0; g < G; ++g) acc0[g] = acc1[g] = fVec(0.f);
  for (int64_t c = 0; c < head_size; c += kVecSize) {
    const fVec up0 = load_codes8(rows0, c), down0 = load_codes8(rows0 + head_size, c);
    const fVec up1 = load_codes8(rows1, c), down1 = load_codes8(rows1 + head_size, c);
    for (int64_t g = 0; g < G; ++g) {
      const fVec positive = fVec::loadu(w + g * 2 * head_size + c);
      const fVec negative = fVec::loadu(w + g * 2 * head_size + head_size + c);
      acc0[g] = at::vec::fmadd(negative, down0, at::vec::fmadd(positive, up0, acc0[g]));
      acc1[g] = at::vec::fmadd(negative, down1, at::vec::fmadd(positive, up1, acc1[g]));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    best[0] = std::max(best[0], sum_lanes(acc0[g]) - offs[g]);
    best[1] = std::max(best[1], sum_lanes(acc1[g]) - offs[g]);
  }
}

// pair_bound8 over a whole query group, kGroupChunk heads at a time.
inline void group_pair_bound8(const uint8_t* rows0, const uint8_t* rows1, int64_t head_size,
                              const float* w, const float* offs, int64_t query_group,
                              float* best) {
  best[0] = best[1] = kNegInf;
  for_each_group_chunk(query_group, [&](auto heads, int64_t g) {
    pair_bound8<decltype(heads)::value>(rows0, rows1, head_size, w + g * 2 * head_size,
                                        offs + g, best);
  });
}

// unit_bound over a whole query group of any size, kGroupChunk heads at a time.
inline float group_bound(const uint8_t* rows, int64_t row_bytes, const float* w,
                         const float* offs, int64_t query_group, int64_t bits,
                         int64_t head_size, int64_t segment, int64_t vector_end) {
  float best = kNegInf;
  for_each_group_chunk(query_group, [&](auto heads, int64_t g) {
    best = std::max(best, unit_bound<decltype(heads)::value>(
                              rows, row_bytes, w + g * 2 * head_size, offs + g, bits,
                              head_size, segment, vector_end));
  });
  return best;
}

}  // namespace bound_scoring
}  // namespace infinigen

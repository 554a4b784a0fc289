// SPDX-License-Identifier: Apache-2.0
// The int-key scoring of one 16-token group on AVX-512 builds (for
// int_keys.cpp's select_tokens_int; the layout of the codes is described
// there).
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include <cstdint>

namespace infinigen {

// AVX-512 scoring of a group: every channel's 16 codes become one 16-lane
// float vector in registers, in the same positions as ``unpack_codes`` (phase-
// major for 1, 2 and 4 bits, token order for 3), for 2-3 ALU instructions per
// channel instead of the portable path's unpack through memory:
//   1. one 16-byte load holds kRows = 16 / (2 * bits) whole rows (channels; 2
//      for 3 bits), broadcast to the four 128-bit lanes (the load port alone);
//   2. vpshufb (in-lane, so each lane sees all 16 bytes) puts, for each
//      position of a row, the byte holding its code into the low byte of the
//      position's dword (with the next byte above it where a 3-bit code
//      straddles two bytes);
//   3. vpsrlvd brings the code to bits 0 .. bits - 1. With 2 and 4 bits every
//      128-bit lane (4 positions) is one phase, so this shift goes once on the
//      loaded bytes, before vpshufb, for all kRows rows: the bits shifted in
//      from the next byte land above the code;
//   4. vpermps reads a float table indexed by the low 4 bits of each dword,
//      table[i] = i & (2^bits - 1): the integer-to-float conversion and the
//      mask of the bits above the code in one instruction.
// The FMAs then take each query head's weight as a broadcast memory operand.
template <int kBits>
struct Spread {
  static constexpr int kBytes = 2 * kBits;    // one row
  static constexpr int kRows = 16 / kBytes;   // rows per 16-byte load
  static constexpr bool kPhaseMajor = 8 % kBits == 0;
  static constexpr bool kShiftFirst = kBits == 2 || kBits == 4;  // one shift per 128-bit lane
  static constexpr int byte_of(int k) { return kPhaseMajor ? k % kBytes : kBits * k / 8; }
  static constexpr int shift_of(int k) { return kPhaseMajor ? kBits * (k / kBytes) : kBits * k % 8; }

  __m512i index[kRows];  // vpshufb control of each row of a load
  __m512i shifts;        // dword shift counts (position k's)
  __m512 table;

  Spread() {
    alignas(64) int8_t bytes[64];
    alignas(64) int32_t counts[16];
    alignas(64) float values[16];
    for (int j = 0; j < kRows; ++j) {
      for (int k = 0; k < 16; ++k) {
        const int byte = j * kBytes + byte_of(k);
        bytes[4 * k] = static_cast<int8_t>(byte);
        bytes[4 * k + 1] = static_cast<int8_t>(byte + 1 < 16 ? byte + 1 : -128);  // -128: zero
        bytes[4 * k + 2] = bytes[4 * k + 3] = -128;
      }
      index[j] = _mm512_load_si512(bytes);
    }
    for (int k = 0; k < 16; ++k) {
      counts[k] = shift_of(k);
      values[k] = static_cast<float>(k & ((1 << kBits) - 1));
    }
    shifts = _mm512_load_si512(counts);
    table = _mm512_load_ps(values);
  }

  // The loaded bytes as the unpack of row j takes them.
  inline __m512i prepare(__m128i loaded) const {
    const __m512i lanes = _mm512_broadcast_i32x4(loaded);
    return kShiftFirst ? _mm512_srlv_epi32(lanes, shifts) : lanes;
  }
  inline __m512 unpack(__m512i prepared, int j) const {
    __m512i codes = _mm512_shuffle_epi8(prepared, index[j]);
    if (!kShiftFirst) codes = _mm512_srlv_epi32(codes, shifts);
    return _mm512_permutexvar_ps(codes, table);
  }
};

// ``group_scores`` for AVX-512: best = max over query heads g0 .. g0 + kG of
// the group's 16 scores (positions as ``unpack_codes``'s). Two accumulators
// per head (even and odd channels): one chain of head_size dependent FMAs
// would wait on the FMA latency.
template <int kBits, int kG>
inline void group_scores_avx512(const uint8_t* rows, int64_t head_size, const float* weights,
                                const float* offsets, int64_t g0, const Spread<kBits>& spread,
                                __m512& best) {
  using S = Spread<kBits>;
  __m512 acc[2][kG];
  for (int i = 0; i < kG; ++i) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
  const float* w = weights + g0 * head_size;
  auto feed = [&](__m512 codes, int64_t c, int parity) {
    for (int i = 0; i < kG; ++i)
      acc[parity][i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i * head_size + c]), codes, acc[parity][i]);
  };
  int64_t d = 0;
  // Whole 16-byte loads inside the group's rows.
  for (; (head_size - d) * S::kBytes >= 16; d += S::kRows) {
    const __m512i prepared = spread.prepare(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + d * S::kBytes)));
    for (int j = 0; j < S::kRows; ++j) feed(spread.unpack(prepared, j), d + j, j & 1);
  }
  if (d < head_size) {  // the last rows (fewer than 16 bytes): a masked load reads no further
    const int64_t left = head_size - d;
    const __m512i prepared = spread.prepare(_mm_maskz_loadu_epi8(
        static_cast<__mmask16>((1u << (left * S::kBytes)) - 1), rows + d * S::kBytes));
    for (int j = 0; j < S::kRows; ++j)
      if (j < left) feed(spread.unpack(prepared, j), d + j, j & 1);
  }
  for (int i = 0; i < kG; ++i)
    best = _mm512_max_ps(best, _mm512_sub_ps(_mm512_add_ps(acc[0][i], acc[1][i]),
                                             _mm512_set1_ps(offsets[g0 + i])));
}

template <int kBits>
inline void query_group_scores_avx512(const uint8_t* rows, int64_t head_size,
                                      const float* weights, const float* offsets,
                                      int64_t query_group, __m512& best) {
  static const Spread<kBits> spread;
  int64_t g = 0;
  for (; g + 4 <= query_group; g += 4)
    group_scores_avx512<kBits, 4>(rows, head_size, weights, offsets, g, spread, best);
  for (; g + 2 <= query_group; g += 2)
    group_scores_avx512<kBits, 2>(rows, head_size, weights, offsets, g, spread, best);
  for (; g < query_group; ++g)
    group_scores_avx512<kBits, 1>(rows, head_size, weights, offsets, g, spread, best);
}
}  // namespace infinigen
#endif  // CPU_CAPABILITY_AVX512

// SPDX-License-Identifier: Apache-2.0
// The int-key scoring of one 16-token group (4 query heads, head 128) in the
// product's float form (int_keys_avx512.h: float32 weights = query x scale,
// one 512-bit FMA per channel, query head and 16 tokens) against an integer
// form with AVX-512 VNNI: the weights rounded to int8 per group and query head
// (vpdpbusd: 4 u8 x s8 products per lane), the scale of the rounding from the
// exact max |weight| ("amax") or from the bound max|q| x max(scale) ("bound").
// Not product code: `python -m benchmarks.perf.int_scoring_micro` builds and
// runs it (benchmarks/README.md, "The CPU step profile").
#define CPU_CAPABILITY_AVX512 1
#include "int_keys_avx512.h"  // the product's scoring (-I its csrc)
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <vector>
#include <random>
#include <algorithm>
#include <cstdlib>
using namespace infinigen;
constexpr int D = 128, G = 4;

// baseline: float weights prep (as int_keys.cpp) + float scoring
template <int B>
__attribute__((noinline)) __m512 base_group(const uint8_t* rows, const uint16_t* s16, const float* q) {
  alignas(64) float step[D], w[G * D], off[G];
  for (int c = 0; c < D; c += 16) _mm512_store_ps(step + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s16 + c))));
  const float half = 0.5f * ((1 << B) - 1);
  for (int g = 0; g < G; ++g) {
    __m512 sums = _mm512_setzero_ps();
    for (int c = 0; c < D; c += 16) {
      __m512 p = _mm512_mul_ps(_mm512_loadu_ps(q + g * D + c), _mm512_load_ps(step + c));
      _mm512_store_ps(w + g * D + c, p); sums = _mm512_add_ps(sums, p);
    }
    off[g] = half * _mm512_reduce_add_ps(sums);
  }
  __m512 best = _mm512_set1_ps(-INFINITY);
  query_group_scores_avx512<B>(rows, D, w, off, G, best);
  return best;
}

// The codes of 4 channels (rows) as bytes of 16 dword lanes, one per position
// (phase-major, as the product's unpack): vpdpbusd's u8 operand.
template <int B>
struct VSpread {  // 4 channels' codes of 16 positions -> dword lanes, bytes = channels
  __m512i idx_a, idx_b, shifts, mask;
  VSpread() {
    alignas(64) int8_t a[64], b[64]; alignas(64) int32_t cnt[16];
    constexpr int kBytes = 2 * B;  // per row
    for (int k = 0; k < 16; ++k) {
      // phase-major: position k -> byte i, phase p
      int i = k % kBytes, p = k / kBytes;
      cnt[k] = B * p;
      for (int r = 0; r < 4; ++r) {
        int byte = r * kBytes + i;  // within 4 rows (2B*4 bytes)
        if (B == 2) { a[4*k+r] = byte; b[4*k+r] = -128; }
        else { // 4 bits: rows 0,1 in load A (16 bytes), rows 2,3 in load B
          if (r < 2) { a[4*k+r] = byte; b[4*k+r] = -128; } else { a[4*k+r] = -128; b[4*k+r] = byte - 16; }
        }
      }
    }
    idx_a = _mm512_load_si512(a); idx_b = _mm512_load_si512(b);
    shifts = _mm512_load_si512(cnt); mask = _mm512_set1_epi8((1 << B) - 1);
  }
  inline __m512i codes(const uint8_t* rows4) const {
    if (B == 2) {
      __m512i v = _mm512_srlv_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)rows4)), shifts);
      return _mm512_and_si512(_mm512_shuffle_epi8(v, idx_a), mask);
    } else {
      __m512i va = _mm512_srlv_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)rows4)), shifts);
      __m512i vb = _mm512_srlv_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(rows4 + 16))), shifts);
      return _mm512_and_si512(_mm512_or_si512(_mm512_shuffle_epi8(va, idx_a), _mm512_shuffle_epi8(vb, idx_b)), mask);
    }
  }
};

// VNNI: int8 weights per (group, query head), scaled by the exact max |weight|
// (kBound false) or by the bound max|q| x max(scale) (kBound true).
template <int B, bool kBound>
__attribute__((noinline)) __m512 vnni_group(const uint8_t* rows, const uint16_t* s16, const float* q, const float* qmax) {
  static const VSpread<B> sp;
  alignas(64) float step[D]; alignas(64) int8_t w8[G][D]; float off[G], dq[G];
  __m512 smax = _mm512_setzero_ps();
  for (int c = 0; c < D; c += 16) { __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s16 + c))); _mm512_store_ps(step + c, s); smax = _mm512_max_ps(smax, s); }
  const float half = 0.5f * ((1 << B) - 1);
  float sm = kBound ? _mm512_reduce_max_ps(smax) : 0.f;
  for (int g = 0; g < G; ++g) {
    __m512 p[D / 16];
    float amax;
    if (kBound) { amax = qmax[g] * sm; for (int c = 0; c < D / 16; ++c) p[c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * c), _mm512_load_ps(step + 16 * c)); }
    else {
      __m512 m = _mm512_setzero_ps();
      for (int c = 0; c < D / 16; ++c) { p[c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * c), _mm512_load_ps(step + 16 * c)); m = _mm512_max_ps(m, _mm512_abs_ps(p[c])); }
      amax = _mm512_reduce_max_ps(m);
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    dq[g] = amax / 127.f;
    __m512i sum = _mm512_setzero_si512();
    for (int c = 0; c < D / 16; ++c) {
      __m512i iv = _mm512_cvtps_epi32(_mm512_mul_ps(p[c], _mm512_set1_ps(inv)));
      sum = _mm512_add_epi32(sum, iv);
      _mm_store_si128((__m128i*)(w8[g] + 16 * c), _mm512_cvtsepi32_epi8(iv));
    }
    off[g] = half * (float)_mm512_reduce_add_epi32(sum);
  }
  __m512i acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_si512();
  constexpr int kRowBytes = 2 * B;
  for (int c = 0; c < D; c += 4) {
    __m512i cv = sp.codes(rows + c * kRowBytes);
    for (int g = 0; g < G; ++g) {
      int32_t wd; std::memcpy(&wd, w8[g] + c, 4);
      acc[g] = _mm512_dpbusd_epi32(acc[g], cv, _mm512_set1_epi32(wd));
    }
  }
  __m512 best = _mm512_set1_ps(-INFINITY);
  for (int g = 0; g < G; ++g)
    best = _mm512_max_ps(best, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(acc[g]), _mm512_set1_ps(off[g])), _mm512_set1_ps(dq[g])));
  return best;
}

template <int B>
void run(int groups) {
  const int rowb = D * 2 * B;
  std::vector<uint8_t> codes((size_t)groups * rowb);
  std::vector<uint16_t> sc((size_t)groups * D);
  std::mt19937 gen(1);
  for (auto& x : codes) x = gen() & 0xFF;
  std::vector<float> q(G * D), qmax(G, 0.f);
  std::normal_distribution<float> nd;
  for (auto& x : q) x = nd(gen);
  for (int g = 0; g < G; ++g) for (int c = 0; c < D; ++c) qmax[g] = std::max(qmax[g], std::fabs(q[g*D+c]));
  for (size_t i = 0; i < sc.size(); ++i) sc[i] = _cvtss_sh(0.05f + 0.1f * ((gen() % 100) / 100.f), 0);
  std::vector<float> out(16 * (size_t)groups);
  // agreement: the VNNI form (exact max) against the product's float form, 64 groups
  double maxerr = 0, maxval = 0;
  for (int gi = 0; gi < 64; ++gi) {
    __m512 a = base_group<B>(codes.data() + (size_t)gi * rowb, sc.data() + (size_t)gi * D, q.data());
    __m512 b = vnni_group<B, false>(codes.data() + (size_t)gi * rowb, sc.data() + (size_t)gi * D, q.data(), qmax.data());
    alignas(64) float x[16], y[16]; _mm512_store_ps(x, a); _mm512_store_ps(y, b);
    for (int k = 0; k < 16; ++k) { maxerr = std::max(maxerr, (double)std::fabs(x[k]-y[k])); maxval = std::max(maxval, (double)std::fabs(x[k])); }
  }
  printf("bits %d: max |base - vnni| %.4g of max |score| %.4g\n", B, maxerr, maxval);
  std::vector<double> times[3];
  for (int rep = 0; rep < 9; ++rep) {
    for (int mode = 0; mode < 3; ++mode) {
      auto t0 = std::chrono::steady_clock::now();
      for (int gi = 0; gi < groups; ++gi) {
        const uint8_t* r = codes.data() + (size_t)gi * rowb; const uint16_t* s = sc.data() + (size_t)gi * D;
        __m512 v = mode == 0 ? base_group<B>(r, s, q.data()) : mode == 1 ? vnni_group<B, false>(r, s, q.data(), qmax.data()) : vnni_group<B, true>(r, s, q.data(), qmax.data());
        _mm512_storeu_ps(out.data() + 16 * (size_t)gi, v);
      }
      auto t1 = std::chrono::steady_clock::now();
      times[mode].push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / groups);
    }
  }
  const char* names[3] = {"float (product)", "int8 vnni, amax", "int8 vnni, bound"};
  for (int mode = 0; mode < 3; ++mode) {
    std::sort(times[mode].begin(), times[mode].end());
    printf("bits %d %-18s %6.1f ns per group (median of 9 interleaved rounds)\n", B, names[mode], times[mode][4]);
  }
}
int main(int argc, char** argv) { int n = argc > 1 ? atoi(argv[1]) : 28672; run<4>(n); run<2>(n); }

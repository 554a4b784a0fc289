// SPDX-License-Identifier: Apache-2.0
// Shared helpers of InfiniGen's CPU kernels: float loads of every KV dtype,
// pool addressing, and the dtype dispatch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace infinigen {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVecSize = fVec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// A calling thread's scratch of n floats, kept across calls (a selection op's
// scores: rows x KV heads x the longest context). Given back when a call needs
// under a quarter of a large one, or one burst of long contexts would hold its
// peak for the process's life (1 GiB at 32 rows x 8 heads x 1M tokens).
inline float* scratch_floats(std::vector<float>& buffer, int64_t n) {
  constexpr size_t kKeep = size_t{1} << 22;  // 16 MiB: kept whatever the need
  const size_t need = static_cast<size_t>(std::max<int64_t>(1, n));
  if (buffer.capacity() > kKeep && need < buffer.capacity() / 4) std::vector<float>().swap(buffer);
  buffer.resize(need);
  return buffer.data();
}

// kVecSize elements of p as floats.
template <typename T>
inline fVec load_float(const T* p);
template <>
inline fVec load_float<float>(const float* p) {
  return fVec::loadu(p);
}
template <>
inline fVec load_float<at::BFloat16>(const at::BFloat16* p) {
  fVec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}
template <>
inline fVec load_float<at::Half>(const at::Half* p) {
  fVec out;
  at::vec::load_fp32_from_fp16(p, out);
  return out;
}

// FP8 K/V (vLLM's --kv-cache-dtype fp8 / fp8_e4m3: e4m3fn; fp8_e5m2): one
// byte per element, widened through float16. An e5m2 byte is a float16's top
// byte. An e4m3fn byte's exponent and mantissa, shifted into a float16's
// (bias 7 against 15), read its value times 2^-8, subnormals included: the
// byte sign-extended to 16 bits and shifted left by 7 puts its sign in bit 15
// (and a copy in bit 14, cleared) and the rest in bits 7-13. The pool never
// holds e4m3fn's NaN (writes saturate, to_kv).

#if defined(CPU_CAPABILITY_AVX512)
// kVecSize (16) bytes as 16-bit lanes, each byte in the low half (zero- or sign-extended).
inline __m256i widen_bytes(const void* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}
inline __m256i widen_signed_bytes(const void* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}
inline fVec half_bits_to_float(__m256i bits) { return fVec(_mm512_cvtph_ps(bits)); }
#define INFINIGEN_EPI16(OP) _mm256_##OP##_epi16
#define INFINIGEN_SET1_EPI16 _mm256_set1_epi16
#define INFINIGEN_AND _mm256_and_si256
#elif defined(CPU_CAPABILITY_AVX2)
// kVecSize (8) bytes as 16-bit lanes, each byte in the low half (zero- or sign-extended).
inline __m128i widen_bytes(const void* p) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
}
inline __m128i widen_signed_bytes(const void* p) {
  return _mm_cvtepi8_epi16(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
}
inline fVec half_bits_to_float(__m128i bits) { return fVec(_mm256_cvtph_ps(bits)); }
#define INFINIGEN_EPI16(OP) _mm_##OP##_epi16
#define INFINIGEN_SET1_EPI16 _mm_set1_epi16
#define INFINIGEN_AND _mm_and_si128
#endif

template <>
inline fVec load_float<c10::Float8_e5m2>(const c10::Float8_e5m2* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return half_bits_to_float(INFINIGEN_EPI16(slli)(widen_bytes(p), 8));
#else
  alignas(64) float tmp[kVecSize];
  for (int64_t i = 0; i < kVecSize; ++i) tmp[i] = static_cast<float>(p[i]);
  return fVec::loadu(tmp);
#endif
}
template <>
inline fVec load_float<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const auto shifted = INFINIGEN_EPI16(slli)(widen_signed_bytes(p), 7);
  return half_bits_to_float(INFINIGEN_AND(shifted, INFINIGEN_SET1_EPI16(
             static_cast<int16_t>(0xBF80)))) * fVec(256.f);
#else
  alignas(64) float tmp[kVecSize];
  for (int64_t i = 0; i < kVecSize; ++i) tmp[i] = static_cast<float>(p[i]);
  return fVec::loadu(tmp);
#endif
}

// A float as a pool element. FP8 is written as vLLM's CPU build writes its
// FP8 pages (cpu_attn_reshape_and_cache, --kv-cache-dtype fp8 / fp8_e5m2:
// measured on its AVX-512 kernel, tests/unit/test_kernels_fp8.py): rounded
// toward zero and saturating at the format's largest finite value, so that a
// token's K/V is the same value in the pool as in vLLM's pages (select-all
// equals stock; device-first moves and returns bytes vLLM itself would have
// written). vLLM's CUDA build rounds to nearest, as the CUDA platform's kernels
// do (platforms/cuda/kernels/reference.py, pool_rows).
template <typename T>
inline T to_kv(float x) {
  return static_cast<T>(x);
}

// The FP8 code of x with MANTISSA bits and exponent BIAS, rounded toward zero
// and saturated at the code MAX_CODE (the format's largest finite value).
template <typename T, int MANTISSA, int BIAS, uint8_t MAX_CODE>
inline T fp8_toward_zero(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const float magnitude = std::fabs(x);
  // MAX_CODE's value (its exponent and mantissa fields).
  const int max_exponent = (MAX_CODE >> MANTISSA) - BIAS;
  const float max_value = std::ldexp(1.f + static_cast<float>(MAX_CODE & ((1 << MANTISSA) - 1)) /
                                               static_cast<float>(1 << MANTISSA),
                                     max_exponent);
  uint8_t code;
  if (!(magnitude < max_value)) {  // (NaN included: the pool holds no NaN)
    code = MAX_CODE;
  } else if (magnitude < std::ldexp(1.f, 1 - BIAS)) {  // a subnormal of the format
    code = static_cast<uint8_t>(magnitude * std::ldexp(1.f, BIAS - 1 + MANTISSA));
  } else {
    const int exponent = static_cast<int>((bits >> 23) & 0xFF) - 127;
    code = static_cast<uint8_t>(((exponent + BIAS) << MANTISSA) |
                                ((bits >> (23 - MANTISSA)) & ((1u << MANTISSA) - 1)));
  }
  return T(static_cast<uint8_t>(sign | code), T::from_bits());
}
template <>
inline c10::Float8_e4m3fn to_kv<c10::Float8_e4m3fn>(float x) {
  return fp8_toward_zero<c10::Float8_e4m3fn, 3, 7, 0x7E>(x);  // 448
}
template <>
inline c10::Float8_e5m2 to_kv<c10::Float8_e5m2>(float x) {
  return fp8_toward_zero<c10::Float8_e5m2, 2, 15, 0x7B>(x);  // 57344
}

// Sum of a vector's lanes (ATen's generic reduce_add does not compile for DEFAULT).
inline float sum_lanes(const fVec& vec) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return vec.reduce_add();
#else
  alignas(64) float lanes[kVecSize];
  vec.store(lanes);
  float total = 0.f;
  for (int64_t i = 0; i < kVecSize; ++i) total += lanes[i];
  return total;
#endif
}

// The largest lane (ATen's generic reduce_max does not compile for DEFAULT).
inline float max_lanes(const fVec& vec) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return vec.reduce_max();
#else
  alignas(64) float lanes[kVecSize];
  vec.store(lanes);
  return *std::max_element(lanes, lanes + kVecSize);
#endif
}

// The first `count` (< kVecSize) elements of p as floats, zeros after.
template <typename T>
inline fVec load_float_partial(const T* p, int64_t count) {
  alignas(64) float tmp[kVecSize] = {0.f};
  for (int64_t i = 0; i < count; ++i) tmp[i] = static_cast<float>(p[i]);
  return fVec::loadu(tmp);
}

// Where a token's K|V row lives in the pool.
//
// The pool of one layer is [num_units, H_kv, block_size, 2 * D]: a token's K
// and V side by side. Uncapped, a unit is a block of the dense KV-cache
// group and a token at (block_id, offset) sits at unit block_id. Capped,
// `row_map` [num_blocks, H_kv, block_size] (int32, -1: evicted) gives each
// (token, head) its own row r, stored at unit r / block_size, offset
// r % block_size.
struct PoolLayout {
  int64_t num_heads;
  int64_t block_size;
  int64_t row_elems;  // 2 * D
  const int32_t* row_map;  // nullptr: uncapped

  // Element offset of the (block_id, head, offset) entry; -1 when evicted.
  inline int64_t entry(int64_t block_id, int64_t head, int64_t offset) const {
    int64_t unit = block_id, slot = offset;
    if (row_map != nullptr) {
      const int32_t row = row_map[(block_id * num_heads + head) * block_size + offset];
      if (row < 0) return -1;
      unit = row / block_size;
      slot = row % block_size;
    }
    return ((unit * num_heads + head) * block_size + slot) * row_elems;
  }
};

inline PoolLayout pool_layout(const at::Tensor& kv_pool,
                              const std::optional<at::Tensor>& row_map) {
  TORCH_CHECK(kv_pool.dim() == 4 && kv_pool.is_contiguous(),
              "kv_pool must be a contiguous [units, H_kv, block_size, 2 * D] tensor");
  const int32_t* map = nullptr;
  if (row_map.has_value()) {
    const auto& rm = *row_map;
    TORCH_CHECK(rm.scalar_type() == at::kInt && rm.is_contiguous() && rm.dim() == 3 &&
                    rm.size(1) == kv_pool.size(1) && rm.size(2) == kv_pool.size(2),
                "row_map must be a contiguous int32 [num_blocks, H_kv, block_size] tensor");
    map = rm.data_ptr<int32_t>();
  }
  return PoolLayout{kv_pool.size(1), kv_pool.size(2), kv_pool.size(3), map};
}

// Runs the lambda (a lambda using `scalar_t`, the last argument) for the KV dtypes vLLM's CPU backend uses.
#define INFINIGEN_DISPATCH_KV(TYPE, NAME, ...)                                   \
  [&] {                                                                          \
    switch (TYPE) {                                                              \
      case at::kFloat: {                                                         \
        using scalar_t = float;                                                  \
        return __VA_ARGS__();                                                           \
      }                                                                          \
      case at::kBFloat16: {                                                      \
        using scalar_t = at::BFloat16;                                           \
        return __VA_ARGS__();                                                           \
      }                                                                          \
      case at::kHalf: {                                                          \
        using scalar_t = at::Half;                                               \
        return __VA_ARGS__();                                                           \
      }                                                                          \
      default:                                                                   \
        TORCH_CHECK(false, NAME, ": KV dtype must be float32, bfloat16 or float16, got ", \
                    TYPE);                                                       \
    }                                                                            \
  }()

// The pool's element types: the model's dtypes and FP8 (`scalar_t`), for ops
// that read the pool into floats.
#define INFINIGEN_DISPATCH_POOL(TYPE, NAME, ...)                                 \
  [&] {                                                                          \
    switch (TYPE) {                                                              \
      case at::kFloat8_e4m3fn: {                                                 \
        using scalar_t = c10::Float8_e4m3fn;                                     \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      case at::kFloat8_e5m2: {                                                   \
        using scalar_t = c10::Float8_e5m2;                                       \
        return __VA_ARGS__();                                                    \
      }                                                                          \
      default:                                                                   \
        return INFINIGEN_DISPATCH_KV(TYPE, NAME, __VA_ARGS__);                   \
    }                                                                            \
  }()

// The query's (and output's) dtype as `query_t` beside an FP8 pool's `scalar_t`.
#define INFINIGEN_DISPATCH_QUERY_OF_FP8(QUERY, NAME, ...)                        \
  switch (QUERY) {                                                               \
    case at::kFloat: {                                                           \
      using query_t = float;                                                     \
      return __VA_ARGS__();                                                      \
    }                                                                            \
    case at::kBFloat16: {                                                        \
      using query_t = at::BFloat16;                                              \
      return __VA_ARGS__();                                                      \
    }                                                                            \
    case at::kHalf: {                                                            \
      using query_t = at::Half;                                                  \
      return __VA_ARGS__();                                                      \
    }                                                                            \
    default:                                                                     \
      TORCH_CHECK(false, NAME, ": the query dtype must be float32, bfloat16 or float16, got ", \
                  QUERY);                                                        \
  }

// The pool's element type (`scalar_t`) and the query's (`query_t`, also the
// new K/V's and the output's): one dtype, or an FP8 pool beside any of the
// model's dtypes.
#define INFINIGEN_DISPATCH_POOL_QUERY(POOL, QUERY, NAME, ...)                    \
  [&] {                                                                          \
    switch (POOL) {                                                              \
      case at::kFloat8_e4m3fn: {                                                 \
        using scalar_t = c10::Float8_e4m3fn;                                     \
        INFINIGEN_DISPATCH_QUERY_OF_FP8(QUERY, NAME, __VA_ARGS__)                \
      }                                                                          \
      case at::kFloat8_e5m2: {                                                   \
        using scalar_t = c10::Float8_e5m2;                                       \
        INFINIGEN_DISPATCH_QUERY_OF_FP8(QUERY, NAME, __VA_ARGS__)                \
      }                                                                          \
      default:                                                                   \
        TORCH_CHECK(QUERY == POOL, NAME, ": the query and a ", POOL,             \
                    " pool must share a dtype, got ", QUERY);                    \
        return INFINIGEN_DISPATCH_KV(POOL, NAME, [&] {                           \
          using query_t = scalar_t;                                              \
          return __VA_ARGS__();                                                  \
        });                                                                      \
    }                                                                            \
  }()

}  // namespace infinigen

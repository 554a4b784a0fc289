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
#include <limits>
#include <optional>
#include <vector>

namespace infinigen {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVecSize = fVec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

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

}  // namespace infinigen

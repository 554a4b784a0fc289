// SPDX-License-Identifier: Apache-2.0
// The speculation's query (platforms/cpu/query_weights.py): layer i+1's query
// from layer i's attention input, x W_q^T + b, and, given the rotary cache,
// RoPE as vLLM's RotaryEmbedding computes it; all in float32.
//
// One decode row reads the whole W_q per layer and step, so the projection
// is a GEMV whose cost is the weight's bytes: each pass keeps kRows output
// channels' accumulators in registers and loads every input vector once for
// them, and the input rows (a step's decode rows) share each block of W_q
// while it is in the cache.
#include "ops.h"

namespace infinigen {
namespace {

constexpr int64_t kRows = 4;         // output channels per pass
constexpr int64_t kBlockRows = 32;   // output channels per task of the parallel loop

// y[n + r] = x . w[n + r] for r in [0, R): the R rows' accumulators in
// registers, each input vector loaded once for them; x in float32.
template <int64_t R, typename W>
inline void dot_rows(const float* x, const W* w, int64_t in_features, int64_t vector_end,
                     int64_t n, float* y) {
  fVec acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = fVec(0.f);
  for (int64_t k = 0; k < vector_end; k += kVecSize) {
    const fVec xv = fVec::loadu(x + k);
    for (int64_t r = 0; r < R; ++r)
      acc[r] = at::vec::fmadd(load_float(w + (n + r) * in_features + k), xv, acc[r]);
  }
  for (int64_t r = 0; r < R; ++r) {
    float dot = sum_lanes(acc[r]);
    const W* row = w + (n + r) * in_features;
    for (int64_t k = vector_end; k < in_features; ++k) dot += static_cast<float>(row[k]) * x[k];
    y[n + r] = dot;
  }
}

// y[t, n] = x[t] . w[n] for n in [n0, n1): kRows rows a pass, the rest one by one.
template <typename W>
void project_block(const float* x, const W* w, int64_t num_tokens, int64_t in_features,
                   int64_t out_features, int64_t n0, int64_t n1, float* y) {
  const int64_t vector_end = in_features / kVecSize * kVecSize;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* xt = x + t * in_features;
    float* yt = y + t * out_features;
    int64_t n = n0;
    for (; n + kRows <= n1; n += kRows) dot_rows<kRows>(xt, w, in_features, vector_end, n, yt);
    for (; n < n1; ++n) dot_rows<1>(xt, w, in_features, vector_end, n, yt);
  }
}

// RoPE of every head of one row in place: the first `rotary_dim` channels of
// each head, neox (channel i with i + rotary_dim / 2) or GPT-J (2i with 2i + 1)
// pairs, cos and sin the halves of the cache's row.
void rotate_row(float* q, const float* cos_sin, int64_t num_heads, int64_t head_size,
                int64_t rotary_dim, bool neox) {
  const int64_t half = rotary_dim / 2;
  const float* cos = cos_sin;
  const float* sin = cos_sin + half;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* head = q + h * head_size;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
      const float x = head[a], y = head[b];
      head[a] = x * cos[i] - y * sin[i];
      head[b] = y * cos[i] + x * sin[i];
    }
  }
}

}  // namespace

at::Tensor speculation_query(const at::Tensor& hidden, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& cos_sin_cache,
                             const std::optional<at::Tensor>& positions, int64_t head_size,
                             bool is_neox_style) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && weight.is_contiguous() &&
                  hidden.size(1) == weight.size(1),
              "hidden [T, K] and contiguous weight [N, K] expected");
  const int64_t num_tokens = hidden.size(0), in_features = hidden.size(1);
  const int64_t out_features = weight.size(0);
  const at::Tensor x = hidden.to(at::kFloat).contiguous();
  auto out = at::empty({num_tokens, out_features}, hidden.options().dtype(at::kFloat));
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t num_blocks = (out_features + kBlockRows - 1) / kBlockRows;
  auto project = [&](auto* w) {
    at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
      project_block(xp, w, num_tokens, in_features, out_features, begin * kBlockRows,
                    std::min(end * kBlockRows, out_features), yp);
    });
  };
  switch (weight.scalar_type()) {
    case at::kFloat: project(weight.data_ptr<float>()); break;
    case at::kBFloat16: project(weight.data_ptr<at::BFloat16>()); break;
    case at::kHalf: project(weight.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "weight: float32, bfloat16 or float16");
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == out_features, "bias: [N]");
    out.add_(bias->to(at::kFloat).view({1, out_features}));
  }
  if (cos_sin_cache.has_value()) {
    TORCH_CHECK(positions.has_value() && positions->numel() == num_tokens &&
                    positions->scalar_type() == at::kLong,
                "positions: [T] int64 with the rotary cache");
    TORCH_CHECK(head_size > 0 && out_features % head_size == 0, "N a multiple of head_size");
    // Converted once by the caller: a conversion here would copy the whole
    // cache at every call.
    const at::Tensor& cache = *cos_sin_cache;
    TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.is_contiguous() && cache.dim() == 2,
                "cos_sin_cache: contiguous float32 [positions, rotary_dim]");
    const int64_t rotary_dim = cache.size(1);
    TORCH_CHECK(rotary_dim <= head_size && rotary_dim % 2 == 0,
                "cos_sin_cache: an even rotary_dim <= head_size");
    const at::Tensor pos = positions->contiguous();
    const int64_t* position = pos.data_ptr<int64_t>();
    const float* table = cache.data_ptr<float>();
    for (int64_t t = 0; t < num_tokens; ++t) {
      TORCH_CHECK(position[t] >= 0 && position[t] < cache.size(0), "position past the cache");
      rotate_row(yp + t * out_features, table + position[t] * rotary_dim,
                 out_features / head_size, head_size, rotary_dim, is_neox_style);
    }
  }
  return out;
}

}  // namespace infinigen

// SPDX-License-Identifier: Apache-2.0
// Declarations of InfiniGen's CPU ops (registered in register.cpp).
#pragma once

#include <tuple>

#include "common.h"

namespace infinigen {

void write_pool(at::Tensor& kv_pool, const at::Tensor& key, const at::Tensor& value,
                const at::Tensor& slot_mapping, const std::optional<at::Tensor>& row_map,
                double key_scale, double value_scale);

void write_partial_keys(at::Tensor& partial_keys, const at::Tensor& key, const at::Tensor& skew,
                        const at::Tensor& slot_mapping);

std::tuple<at::Tensor, at::Tensor> select_tokens(
    const at::Tensor& partial_query, const at::Tensor& partial_keys,
    const at::Tensor& block_table, const at::Tensor& context_lens, const at::Tensor& token_caps,
    double scale, double alpha, int64_t sink_tokens, int64_t recent_tokens,
    const std::optional<at::Tensor>& row_map);

// Integer speculation keys (int_keys.cpp): every key channel in `bits` bits per
// 16-token group, one float16 scale per channel and group.
constexpr int64_t kKeyGroupTokens = 16;  // tokens per group (layout.KEY_GROUP)

void write_int_keys(at::Tensor& codes, at::Tensor& scales, const at::Tensor& kv_pool,
                    const at::Tensor& slot_mapping, const std::optional<at::Tensor>& row_map);

std::tuple<at::Tensor, at::Tensor> select_tokens_int(
    const at::Tensor& query, const at::Tensor& codes, const at::Tensor& scales,
    const at::Tensor& kv_pool, const at::Tensor& block_table, const at::Tensor& context_lens,
    const at::Tensor& token_caps, double scale, double alpha, int64_t sink_tokens,
    int64_t recent_tokens, const std::optional<at::Tensor>& row_map);

// Bound speculation keys (bounds.cpp): per unit of block_size / bounds.size(2)
// tokens and KV head, each channel's max and min key in 8 or 4 bits and one
// float16 scale; selection of whole units by their upper bound of q . k.
void write_bounds(at::Tensor& bounds, at::Tensor& scales, const at::Tensor& kv_pool,
                  const at::Tensor& slot_mapping, const std::optional<at::Tensor>& row_map);

std::tuple<at::Tensor, at::Tensor> select_bounds(
    const at::Tensor& query, const at::Tensor& bounds, const at::Tensor& scales,
    const at::Tensor& kv_pool, const at::Tensor& block_table, const at::Tensor& context_lens,
    const at::Tensor& token_caps, double scale, double alpha, int64_t sink_tokens,
    int64_t recent_tokens, const std::optional<at::Tensor>& row_map);

// Passes 2 and 3 of every selection (select.cpp): the alpha count, the budget,
// the window and each head's top-k from scores [B, H_kv, max_len] (-inf: absent).
std::tuple<at::Tensor, at::Tensor> select_from_scores(float* scores, const int64_t* lens,
                                                      const int64_t* caps, int64_t num_rows,
                                                      int64_t num_heads, int64_t max_len,
                                                      double alpha, int64_t sink_tokens,
                                                      int64_t recent_tokens);

// The step's rows, checked alike by every selection op.
void check_selection_rows(const at::Tensor& block_table, const at::Tensor& context_lens,
                          const at::Tensor& token_caps);

at::Tensor attend_decode(const at::Tensor& query, const at::Tensor& kv_pool,
                         const at::Tensor& block_table, const at::Tensor& context_lens,
                         const std::optional<at::Tensor>& positions,
                         const std::optional<at::Tensor>& row_map, double scale,
                         const std::optional<at::Tensor>& probs,
                         const std::optional<at::Tensor>& stats, double key_scale,
                         double value_scale);

void attend_prefill(const at::Tensor& query, at::Tensor& output, const at::Tensor& kv_pool,
                    const at::Tensor& block_table, const at::Tensor& query_start,
                    const at::Tensor& seq_lens, const at::Tensor& requests,
                    const std::optional<at::Tensor>& row_map, double scale, double key_scale,
                    double value_scale);

// The short path of a sparse layer in one call (short.cpp): write_pool, then
// write_int_keys (when a slot closes a group; key_codes/key_scales given),
// write_bounds (bounds/bound_scales given) or write_partial_keys
// (partial_keys/skew given), then attend_decode in dense
// mode over the first context_lens.size(0) query rows; copied into `out`'s
// first rows when given.
at::Tensor decode_short(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        at::Tensor& kv_pool, const at::Tensor& slot_mapping,
                        const at::Tensor& block_table, const at::Tensor& context_lens,
                        const std::optional<at::Tensor>& row_map, double scale,
                        const std::optional<at::Tensor>& key_codes,
                        const std::optional<at::Tensor>& key_scales,
                        const std::optional<at::Tensor>& partial_keys,
                        const std::optional<at::Tensor>& skew,
                        const std::optional<at::Tensor>& stats,
                        const std::optional<at::Tensor>& out,
                        const std::optional<at::Tensor>& bounds,
                        const std::optional<at::Tensor>& bound_scales, double key_scale,
                        double value_scale);

// The speculation's query (query.cpp): hidden [T, K] x weight [N, K]^T + bias,
// then, given cos_sin_cache [positions, rotary_dim] float32 and positions [T]
// int64, RoPE of each head of head_size channels; [T, N] float32.
at::Tensor speculation_query(const at::Tensor& hidden, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& cos_sin_cache,
                             const std::optional<at::Tensor>& positions, int64_t head_size,
                             bool is_neox_style);

void record_uses(const at::Tensor& positions, const at::Tensor& block_table,
                 const at::Tensor& row_map, at::Tensor& count, at::Tensor& last_used,
                 int64_t tick);

}  // namespace infinigen

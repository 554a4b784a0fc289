# SPDX-License-Identifier: Apache-2.0
"""A pure-torch Llama forward whose sparse layers attend over a selection, as InfiniGen's.

Research harness (no vLLM): the weights are a Hugging Face ``LlamaForCausalLM``
(float32), the attention is written out so that rows at positions >= P (the
dense prefix) attend, in every layer >= ``dense_layers``, over the tokens a
selector picks among the positions before them, plus their own::

    positions   0 ........ P-1 | P ...... T-1
    layers < 2  dense            dense
    layers >= 2 dense            own selection among 0..p-1, plus p

which is what vLLM with ``--infinigen-eval-dense-prefix P`` computes (and, for
the last rows of a prompt, teacher-forced decode steps). The dense pass is run
once per sequence (``dense_pass``); ``sparse_pass`` then reruns the sparse
layers for the rows >= P only, reusing the prefix's keys and values, which no
selection changes. Layers are run in order, so earlier sparse layers change
the inputs of later ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (layer_idx, speculation query [H_q, n, D] post-RoPE, keys [H_kv, T, D] post-RoPE,
#  row positions [n]) -> [H_kv, n, T] bool: the tokens each row attends (own excluded).
Selector = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class DensePrefix:
    """One sequence after a dense forward: what every sparse pass reuses."""

    token_ids: torch.Tensor  # [T] int64
    keys: list[torch.Tensor]  # per layer [H_kv, T, D], post-RoPE
    values: list[torch.Tensor]  # per layer [H_kv, T, D]
    first_sparse_input: torch.Tensor  # [T, hidden]: residual entering layer dense_layers
    last_dense_attn_input: torch.Tensor  # [T, hidden]: layer dense_layers-1 after its norm
    logits: torch.Tensor  # [T, V] dense logits


class SparseLlama:
    """The model's layers, run as InfiniGen's sparse layers would run them.

    Args:
        model: A loaded ``LlamaForCausalLM`` (eval mode).
        dense_layers: The first layers attend densely (the product's default 2).
    """

    def __init__(self, model, dense_layers: int = 2):
        config = model.config
        self.model = model
        self.layers = model.model.layers
        self.num_layers = len(self.layers)
        self.dense_layers = dense_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.group = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim ** -0.5
        self.dtype = model.model.embed_tokens.weight.dtype  # activations' dtype
        positions = torch.arange(config.max_position_embeddings)[None]
        dummy = torch.zeros(1, dtype=torch.float32)
        cos, sin = model.model.rotary_emb(dummy, positions)
        self.cos, self.sin = cos[0].float(), sin[0].float()  # [max_pos, D]

    # -- pieces of one layer -------------------------------------------------

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [H, n, D] at ``positions`` [n] -> rotated."""
        return x * self.cos[positions] + rotate_half(x) * self.sin[positions]

    def query(self, layer_idx: int, attn_input: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        """[H_q, n, D] post-RoPE query of ``layer_idx`` from attention inputs [n, hidden]."""
        q = self.layers[layer_idx].self_attn.q_proj(attn_input)
        q = q.view(-1, self.num_heads, self.head_dim).transpose(0, 1)
        return self.rope(q.float(), positions).to(self.dtype)

    def key_value(self, layer_idx: int, attn_input: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.layers[layer_idx].self_attn
        k = attn.k_proj(attn_input).view(-1, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v = attn.v_proj(attn_input).view(-1, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return self.rope(k.float(), positions).to(self.dtype), v

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               allowed: torch.Tensor) -> torch.Tensor:
        """q: [H_q, n, D]; keys, values: [H_kv, T, D]; allowed: [H_kv or 1, n, T] -> [n, H_q*D]."""
        q = q.float().view(self.num_kv_heads, self.group, q.shape[1], self.head_dim)
        logits = torch.einsum("hgnd,htd->hgnt", q, keys.float()) * self.scale
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.einsum("hgnt,htd->hgnd", torch.softmax(logits, dim=-1), values.float())
        return out.reshape(self.num_heads, -1, self.head_dim).transpose(0, 1).reshape(
            -1, self.num_heads * self.head_dim).to(self.dtype)

    def attend_causal(self, q: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor) -> torch.Tensor:
        """``attend`` with the causal mask over a whole sequence, by torch's fused
        attention (no [H, T, T] logits in memory: a 8K-token sequence's dense pass
        ~6x faster on two cores); the same arithmetic in float32, other rounding."""
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float()[None], keys.float()[None], values.float()[None], is_causal=True,
            scale=self.scale, enable_gqa=True)[0]
        return out.transpose(0, 1).reshape(-1, self.num_heads * self.head_dim).to(self.dtype)

    def finish_layer(self, layer_idx: int, residual: torch.Tensor,
                     attn_out: torch.Tensor) -> torch.Tensor:
        layer = self.layers[layer_idx]
        hidden = residual + layer.self_attn.o_proj(attn_out)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden))

    # -- passes ----------------------------------------------------------------

    @torch.no_grad()
    def dense_pass(self, token_ids: list[int] | torch.Tensor) -> DensePrefix:
        """Dense causal forward of one sequence; keeps every layer's keys and values."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64)
        num_tokens = ids.shape[0]
        positions = torch.arange(num_tokens)
        hidden = self.model.model.embed_tokens(ids)
        keys, values = [], []
        first_sparse_input = last_dense_input = None
        for idx in range(self.num_layers):
            if idx == self.dense_layers:
                first_sparse_input = hidden
            attn_input = self.layers[idx].input_layernorm(hidden)
            if idx == self.dense_layers - 1:
                last_dense_input = attn_input
            k, v = self.key_value(idx, attn_input, positions)
            keys.append(k)
            values.append(v)
            out = self.attend_causal(self.query(idx, attn_input, positions), k, v)
            hidden = self.finish_layer(idx, hidden, out)
        return DensePrefix(ids, keys, values, first_sparse_input, last_dense_input,
                           self.logits(hidden))

    @torch.no_grad()
    def sparse_pass(self, prefix: DensePrefix, num_dense_rows: int, selector: Selector,
                    speculation: str = "previous-layer") -> torch.Tensor:
        """Logits [T - P, V] of rows P..T-1 when the sparse layers attend over ``selector``'s
        choice; P = ``num_dense_rows``.

        ``speculation``: ``previous-layer`` scores with layer l's query computed
        from layer l-1's attention input (InfiniGen); ``same-layer`` with its own.
        """
        first = num_dense_rows
        num_tokens = prefix.token_ids.shape[0]
        positions = torch.arange(first, num_tokens)
        hidden = prefix.first_sparse_input[first:]
        previous_input = prefix.last_dense_attn_input[first:]
        own = positions[:, None] == torch.arange(num_tokens)[None, :]  # [n, T]
        for idx in range(self.dense_layers, self.num_layers):
            attn_input = self.layers[idx].input_layernorm(hidden)
            k_new, v_new = self.key_value(idx, attn_input, positions)
            keys = torch.cat([prefix.keys[idx][:, :first], k_new], dim=1)
            values = torch.cat([prefix.values[idx][:, :first], v_new], dim=1)
            q = self.query(idx, attn_input, positions)
            spec = q if speculation == "same-layer" else self.query(idx, previous_input,
                                                                    positions)
            allowed = selector(idx, spec, keys, positions) | own[None]
            hidden = self.finish_layer(idx, hidden, self.attend(q, keys, values, allowed))
            previous_input = attn_input
        return self.logits(hidden)

    @torch.no_grad()
    def calibration_activations(self, chunks: list[list[int]], speculative: bool = False
                                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (queries [H_q, N, D], keys [H_kv, N, D]) post-RoPE on ``chunks`` (dense).

        ``speculative``: the queries are layer l's projection of layer l-1's
        attention input (what previous-layer speculation scores with).
        """
        out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]
        for chunk in chunks:
            ids = torch.as_tensor(chunk, dtype=torch.int64)
            positions = torch.arange(ids.shape[0])
            causal = torch.ones(len(chunk), len(chunk), dtype=torch.bool).tril()[None]
            hidden = self.model.model.embed_tokens(ids)
            previous = None
            for idx in range(self.num_layers):
                attn_input = self.layers[idx].input_layernorm(hidden)
                q = self.query(idx, attn_input, positions)
                k, v = self.key_value(idx, attn_input, positions)
                spec = q if (not speculative or previous is None) else self.query(
                    idx, previous, positions)
                out[idx].append((spec, k))
                hidden = self.finish_layer(idx, hidden, self.attend(q, k, v, causal))
                previous = attn_input
        return [(torch.cat([q for q, _ in parts], 1), torch.cat([k for _, k in parts], 1))
                for parts in out]

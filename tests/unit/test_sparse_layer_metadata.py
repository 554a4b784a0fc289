# SPDX-License-Identifier: Apache-2.0
"""The sparse layers' KV-cache groups build no attention metadata (nothing reads it)."""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from vllm_infinigen.worker.attention import SPARSE_METADATA, sparse_backend


def test_sparse_backend_builds_a_marker_and_reuses_it_across_groups():
    backend = sparse_backend(CPUAttentionBackend)
    assert sparse_backend(CPUAttentionBackend) is backend  # one class: one vLLM group key
    assert issubclass(backend, CPUAttentionBackend)
    assert backend.full_cls_name() != CPUAttentionBackend.full_cls_name()
    assert backend.get_name() == CPUAttentionBackend.get_name()
    builder_cls = backend.get_builder_cls()
    assert issubclass(builder_cls, CPUAttentionBackend.get_builder_cls())
    builder = object.__new__(builder_cls)  # build reads nothing of the builder
    assert builder.build(0, object()) is SPARSE_METADATA
    assert builder_cls.supports_update_block_table
    assert builder.update_block_table(SPARSE_METADATA, None, None) is SPARSE_METADATA


def test_on_the_cpu_vllm_makes_no_kv_update_call_and_the_forward_writes():
    """``writes_in_forward`` (the CPU): the backend declares that its forward
    writes, so vLLM's Attention skips ``unified_kv_cache_update``; the impl's
    forward reads the same declaration. Without it (CUDA) vLLM's call stays."""
    from types import SimpleNamespace

    from vllm_infinigen.worker.attention import writes_in_forward

    writing = sparse_backend(CPUAttentionBackend, writes_in_forward=True)
    separate = sparse_backend(CPUAttentionBackend)
    assert writing is not separate and writing.get_name() == separate.get_name()
    assert not CPUAttentionBackend.forward_includes_kv_cache_update
    assert writing.forward_includes_kv_cache_update
    assert not separate.forward_includes_kv_cache_update
    assert writes_in_forward(SimpleNamespace(attn_backend=writing))
    assert not writes_in_forward(SimpleNamespace(attn_backend=separate))
    assert not writes_in_forward(None)  # no layer (tests driving the impl alone)


def test_a_dense_backend_whose_metadata_lacks_the_plans_fields_is_refused():
    """The step plan reads the dense layers' query_start_loc, seq_lens and
    block_table: vLLM's CPU, FlashAttention, Triton and Flex backends keep them;
    one that does not (vLLM's FlashInfer) is refused at install, naming the flag."""
    import dataclasses

    import pytest
    from vllm.v1.attention.backend import AttentionMetadataBuilder
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    from vllm_infinigen.worker.attention import check_dense_backend

    for backend in (CPUAttentionBackend, FlashAttentionBackend, TritonAttentionBackend,
                    FlexAttentionBackend):
        check_dense_backend(backend)

    @dataclasses.dataclass
    class PlannedElsewhere:  # FlashInferMetadata's kind: per-phase wrappers
        num_actual_tokens: int
        slot_mapping: object

    class Builder(AttentionMetadataBuilder[PlannedElsewhere]):
        pass

    class Backend(CPUAttentionBackend):
        @staticmethod
        def get_name() -> str:
            return "FLASHINFER"

        @staticmethod
        def get_builder_cls():
            return Builder

    with pytest.raises(ValueError, match="FLASHINFER backend keeps no block_table, "
                       "query_start_loc, seq_lens; start with --attention-backend FLASH_ATTN"):
        check_dense_backend(Backend)


def test_no_layer_offers_vllms_attention_output_quant_fusion():
    """The sparse layers write unquantized output (no output scale): a wrapped impl,
    dense or sparse, declines vLLM's fusion even where its own backend offers it."""
    from types import SimpleNamespace

    from vllm_infinigen.worker.attention import InfiniGenImplMixin

    class Fusing:
        def fused_output_quant_supported(self, quant_key) -> bool:
            return True

    for sparse in (False, True):
        wrapped = InfiniGenImplMixin.wrap(Fusing(), SimpleNamespace(),
                                          SimpleNamespace(sparse=sparse))
        assert Fusing().fused_output_quant_supported(None)
        assert wrapped.fused_output_quant_supported(None) is False

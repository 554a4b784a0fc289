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

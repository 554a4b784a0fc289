# SPDX-License-Identifier: Apache-2.0
"""vLLM internals the tests hold our mirrors to, found where this vLLM line keeps them."""

from __future__ import annotations


def kv_cache_groups_uniform_page_size(specs: dict) -> list:
    """vLLM's grouping of same-page-size layer specs into KV-cache groups."""
    try:  # vLLM 0.33 moved the KV-cache planning out of kv_cache_utils
        from vllm.v1.core.kv_cache_planning import _get_kv_cache_groups_uniform_page_size
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size
    return _get_kv_cache_groups_uniform_page_size(specs)

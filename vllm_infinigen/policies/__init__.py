# SPDX-License-Identifier: Apache-2.0
"""Selection policies (``--infinigen-policy``) and their registry.

A policy decides which context tokens a sparse layer's selecting rows attend
to; the pool, the attention kernels and the step plan are shared by all of
them. Each lives in one file of this package as a ``SelectionPolicy``
subclass (``base.py``), registered here by name with the traits the settings
check before any engine starts::

    infinigen   infinigen.py  layer i speculates for layer i+1 (the paper)
    h2o         h2o.py        heavy hitters + recent tokens, evicting for good
    streaming   streaming.py  attention sinks + recent tokens
    quest       quest.py      query-aware pages from per-page key bounds

A new policy is one new file plus its line in ``_REGISTRY``. This module
imports no policy (nor torch) until a class is asked for, so every process
can validate names and traits cheaply.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyTraits:
    """What the settings need to know of a policy, without importing it."""

    path: str  # "module:class" of its ``SelectionPolicy``
    # Runs on a pool capped by --infinigen-cpu-pool-gib (tokens may be evicted).
    supports_capped_pool: bool = False
    # Runs over FP8 K/V (--kv-cache-dtype fp8*); otherwise ``FP8_KV_REFUSAL``.
    supports_fp8_kv: bool = False
    # Why --infinigen-eval-dense-prefix cannot measure it (None: it can).
    eval_mode_refusal: str | None = None
    # Tokens per page of its per-slot state (pages of slot ids): the block
    # size must be a multiple, so that no page spans two blocks.
    page_tokens: int = 1
    # Why it cannot run with vLLM's prefix caching (None: it can): a cached
    # prefix's pool rows and keys are shared with whatever request hits it.
    prefix_caching_refusal: str | None = None
    # Why it cannot run under --infinigen-residency device-first (None: it can):
    # a resident step attends with vLLM's kernel, not the policy's.
    device_first_refusal: str | None = None


_REGISTRY = {
    "infinigen": PolicyTraits("vllm_infinigen.policies.infinigen:InfiniGenPolicy",
                              supports_capped_pool=True, supports_fp8_kv=True),
    "h2o": PolicyTraits(
        "vllm_infinigen.policies.h2o:H2OPolicy",
        eval_mode_refusal="H2O's scores accumulate over decode steps one token at a time, "
        "which a single prefill cannot reproduce; measure H2O by teacher-forced decoding "
        "(benchmarks/accuracy/teacher_forcing.py)",
        prefix_caching_refusal="H2O keeps each token's accumulated attention, and its "
        "evictions, per slot of the request that computed it: a request hitting a cached "
        "prefix would inherit another request's scores and evictions",
        device_first_refusal="H2O accumulates each token's attention in its own attention "
        "calls, which vLLM's kernel makes instead while the engine is resident: after a move "
        "its scores would start empty"),
    "streaming": PolicyTraits("vllm_infinigen.policies.streaming:StreamingPolicy"),
    "quest": PolicyTraits("vllm_infinigen.policies.quest:QuestPolicy", page_tokens=16),
}
POLICY_NAMES = tuple(_REGISTRY)
POLICY_TRAITS = _REGISTRY
# Why a policy without ``supports_fp8_kv`` cannot run over FP8 K/V.
FP8_KV_REFUSAL = "reads the pool with torch in the model's dtype"


def check_block_size(block_size: int) -> None:
    """A running engine may switch to any policy, so the block size of the
    dense group must suit the pages of every one (``PolicyTraits.page_tokens``).

    Raises:
        ValueError: Naming the multiple and ``--block-size``.
    """
    multiple = math.lcm(*(traits.page_tokens for traits in _REGISTRY.values()))
    if block_size % multiple:
        raise ValueError(f"InfiniGen needs a block size that is a multiple of "
                         f"{multiple}; got --block-size {block_size}")


def policy_class(name: str) -> type:
    """The ``SelectionPolicy`` subclass registered as ``name``.

    Raises:
        ValueError: On an unknown name, naming the flag and the known ones.
    """
    if name not in _REGISTRY:
        raise ValueError(
            f"--infinigen-policy must be one of {list(POLICY_NAMES)}, got {name!r}"
        )
    module, _, cls = _REGISTRY[name].path.partition(":")
    return getattr(importlib.import_module(module), cls)

# SPDX-License-Identifier: Apache-2.0
"""Selection policies (``--infinigen-policy``) and their registry.

A policy decides which context tokens a sparse layer's selecting rows attend
to; the pool, the attention kernels and the step plan are shared by all of
them. Each lives in one file of this package as a ``SelectionPolicy``
subclass (``base.py``), registered here by name::

    infinigen   infinigen.py  layer i speculates for layer i+1 (the paper)
    h2o         h2o.py        heavy hitters + recent tokens, evicting for good
    streaming   streaming.py  attention sinks + recent tokens
    quest       quest.py      query-aware pages from per-page key bounds

A new policy is one new file plus its line in ``_REGISTRY``. This module
imports no policy (nor torch) until one is asked for, so the front end can
validate names cheaply.
"""

from __future__ import annotations

import importlib

_REGISTRY = {
    "infinigen": "vllm_infinigen.policies.infinigen:InfiniGenPolicy",
    "h2o": "vllm_infinigen.policies.h2o:H2OPolicy",
    "streaming": "vllm_infinigen.policies.streaming:StreamingPolicy",
    "quest": "vllm_infinigen.policies.quest:QuestPolicy",
}
POLICY_NAMES = tuple(_REGISTRY)


def policy_class(name: str) -> type:
    """The ``SelectionPolicy`` subclass registered as ``name``.

    Raises:
        ValueError: On an unknown name, naming the flag and the known ones.
    """
    if name not in _REGISTRY:
        raise ValueError(
            f"--infinigen-policy must be one of {list(POLICY_NAMES)}, got {name!r}"
        )
    module, _, cls = _REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)

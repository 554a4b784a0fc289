# SPDX-License-Identifier: Apache-2.0
"""Every process: applies this package's patches of vLLM (``register()`` calls it)."""

from __future__ import annotations

_applied = False


def apply_all() -> None:
    """Applies every patch once per process."""
    global _applied
    if _applied:
        return
    from vllm_infinigen.patch import patch_arg_utils, patch_omp_reservation, patch_ray

    patch_arg_utils.apply()
    patch_ray.apply()  # after patch_arg_utils: its wrapper runs first
    patch_omp_reservation.apply()
    _applied = True

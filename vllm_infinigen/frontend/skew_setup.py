# SPDX-License-Identifier: Apache-2.0
"""Front end: the skew file an engine starts with, checked or computed before it starts."""

from __future__ import annotations

import time

from vllm.logger import init_logger

from vllm_infinigen.config import InfiniGenConfig
from vllm_infinigen.layout import ModelLayout
from vllm_infinigen.skewing.calibration import BUNDLED_CALIBRATION_NOTE

logger = init_logger(__name__)


def prepare_skew_file(model_dir: str, config: InfiniGenConfig, layout: ModelLayout) -> str:
    """Validates the given skew file, or computes and caches one; returns its path."""
    from vllm_infinigen.skewing.calibration import compute_skew_tables
    from vllm_infinigen.skewing.tables import (
        cached_skew_path,
        load_skew_tables,
        model_fingerprint,
        save_skew_tables,
    )

    fingerprint = model_fingerprint(model_dir)
    shapes = {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
              "head_dim": layout.head_dim}
    if config.skew_file is not None:
        load_skew_tables(config.skew_file, fingerprint, config.partial_ratio, **shapes)
        return config.skew_file
    path = cached_skew_path(fingerprint, config.partial_ratio)
    if path.is_file():
        try:
            load_skew_tables(str(path), fingerprint, config.partial_ratio, **shapes)
            logger.info("InfiniGen: using cached skew file %s", path)
            logger.info(BUNDLED_CALIBRATION_NOTE)
            return str(path)
        except ValueError as e:
            logger.warning("InfiniGen: recomputing unusable cached skew file (%s)", e)
    check_calibration_fits(model_dir)
    start = time.perf_counter()
    tables = compute_skew_tables(model_dir, config.partial_ratio, progress=True)
    save_skew_tables(tables, str(path))
    logger.info(
        "InfiniGen: computed skewing for %s on %d tokens of the bundled calibration "
        "text in %.1f s (cached at %s; `vllm-infinigen prepare` makes one ahead of time)",
        model_dir, tables.calibration_tokens, time.perf_counter() - start, path,
    )
    logger.info(BUNDLED_CALIBRATION_NOTE)
    return str(path)


def check_calibration_fits(model_dir: str, free: int | None = None) -> None:
    """Refuses to calibrate at start-up a model whose calibration would not fit
    in free memory (``skewing.calibration.calibration_memory_bytes``), naming
    the way out.

    Args:
        free: Free bytes (default: what the OS reports as available).
    """
    import psutil

    from vllm_infinigen.skewing.calibration import calibration_memory_bytes

    needed = calibration_memory_bytes(model_dir)
    free = psutil.virtual_memory().available if free is None else free
    if needed > free:
        raise ValueError(
            f"--kv-manager infinigen: computing the skewing of {model_dir} at start-up "
            f"needs about {needed / 2**30:.1f} GiB, but {free / 2**30:.1f} GiB are free; "
            f"run `vllm-infinigen prepare {model_dir} --out FILE` ahead of time (where "
            "the memory is free) and pass --infinigen-skew-file FILE"
        )

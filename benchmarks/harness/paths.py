# SPDX-License-Identifier: Apache-2.0
"""Where things are: the repository, ``../shared`` (models and data), results."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Models and data too large for the repository (``VLLM_INFINIGEN_SHARED`` overrides).
SHARED = Path(os.environ.get("VLLM_INFINIGEN_SHARED", REPO.parent / "shared"))
BUNDLED_MODEL = REPO / "vllm_infinigen" / "assets" / "stories260k"
GUTENBERG = SHARED / "models" / "gutenberg-llama-2k"
# A children's story in TinyStories' style, written for this project: prompts
# the bundled stories260k model understands (and the calibration text bundled
# before the Pride and Prejudice excerpt, compared in the attribution benchmark).
STORY_TEXT = REPO / "benchmarks" / "harness" / "texts" / "story.txt"
RESULTS = REPO / "benchmarks" / "results"
# Built benchmark models, beside the skew files (``VLLM_INFINIGEN_CACHE``).
MODEL_CACHE = Path(os.environ.get(
    "VLLM_INFINIGEN_CACHE", Path.home() / ".cache" / "vllm_infinigen")) / "bench-models"


def shared_path(relative: str) -> Path:
    """A path under ``../shared``, whether or not it exists (a benchmark's default)."""
    return SHARED / relative


def find_shared(relative: str) -> Path | None:
    """A path under ``../shared``; None when it is absent (tests call
    ``tests.shared_data.require_shared``: a skip, or under CI a failure)."""
    path = shared_path(relative)
    return path if path.exists() else None


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a ``.jsonl`` file, or of a gzipped one (``.gz``: the held-out prompts
    of ``benchmarks/data``)."""
    import gzip
    import json

    data = Path(path).read_bytes()
    text = (gzip.decompress(data) if Path(path).suffix == ".gz" else data).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]

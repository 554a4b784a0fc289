# SPDX-License-Identifier: Apache-2.0
"""The CPU pool's pages: 2 MiB (madvise) where the host allows it, a named reason where not."""

from __future__ import annotations

import sys

import pytest
import torch

from vllm_infinigen.platforms.cpu import huge_pages


def _mapping_fields(address: int) -> dict[str, str]:
    """/proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


@pytest.mark.skipif(sys.platform != "linux" or huge_pages.thp_mode() in (None, "never"),
                    reason="needs Linux with transparent huge pages madvise or always")
def test_a_large_pool_is_zero_and_advised_onto_huge_pages():
    pool, pages = huge_pages.zeros_on_huge_pages((64, 4, 16, 256), torch.float32)  # 4 MiB
    assert pages == "2 MiB pages asked for"
    assert pool.shape == (64, 4, 16, 256) and pool.dtype == torch.float32
    assert not pool.any()
    # The kernel marks the advised range eligible for huge pages (whether it
    # finds free 2 MiB frames is the host's matter).
    middle = pool.data_ptr() + pool.nbytes // 2
    assert _mapping_fields(middle).get("THPeligible") == "1"


def test_where_huge_pages_are_off_the_pool_says_so(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    pool, pages = huge_pages.zeros_on_huge_pages((64, 4, 16, 256), torch.bfloat16)
    assert not pool.any() and pool.dtype == torch.bfloat16
    assert pages.startswith("4 KiB pages") and "never" in pages
    if sys.platform != "linux":
        assert "not Linux" in pages


@pytest.mark.skipif(sys.platform != "linux", reason="madvise is Linux's")
def test_a_pool_smaller_than_a_huge_page_keeps_small_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    pool, pages = huge_pages.zeros_on_huge_pages((4, 4, 16, 16), torch.float32)  # 16 KiB
    assert not pool.any()
    assert pages == "4 KiB pages: smaller than a 2 MiB page"


def test_the_host_mode_is_read_from_the_bracketed_choice(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    assert huge_pages.thp_mode() == "madvise"
    monkeypatch.setattr(huge_pages, "THP_SETTING", tmp_path / "missing")
    assert huge_pages.thp_mode() is None

# SPDX-License-Identifier: Apache-2.0
"""The shared machine: progress lines, CPU others used during a measurement, load average.

Others' engines share a 2-core machine and distort step times: the
benchmarks measure how busy the other processes kept the cores and measure a
disturbed window again.
"""

from __future__ import annotations

import os
import sys
import time


class Progress:
    """Progress lines on stderr with the time since start: ``[  12.3 s] message``."""

    def __init__(self, total: int | None = None):
        self.start = time.monotonic()
        self.total = total
        self.done = 0

    def __call__(self, message: str, advance: bool = False) -> None:
        if advance:
            self.done += 1
        count = f" ({self.done}/{self.total})" if self.total and advance else ""
        print(f"[{time.monotonic() - self.start:7.1f} s]{count} {message}",
              file=sys.stderr, flush=True)


class CpuMeter:
    """CPU time of this process and of the whole machine over a ``with`` block.

    ``other_cores`` is how many cores other processes kept busy on average
    (machine busy time minus ours, over the wall time): others' engines on a
    shared 2-core machine distort step times, so a window with ``other_cores``
    well above 0 is worth measuring again. With ``tree=True`` "ours" includes
    the live child processes (an engine core and its workers).
    """

    def __init__(self, tree: bool = False):
        self.tree = tree

    def __enter__(self) -> CpuMeter:
        self._wall, self._busy = time.monotonic(), _machine_busy()
        self._own = _own_cpu(self.tree)
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.monotonic() - self._wall
        self.own = _own_cpu(self.tree) - self._own
        busy = _machine_busy()
        self.busy = None if busy is None or self._busy is None else busy - self._busy

    @property
    def other_cores(self) -> float | None:
        if self.busy is None or self.wall <= 0:
            return None
        return max(0.0, (self.busy - self.own) / self.wall)


def wait_for_quiet(max_cores: float, timeout_s: float, interval_s: float = 1.0) -> float | None:
    """Waits (up to ``timeout_s``) for a ``interval_s`` during which other processes
    used at most ``max_cores``; returns the last measured value (None: no /proc/stat)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with CpuMeter() as meter:
            time.sleep(interval_s)
        if meter.other_cores is None or meter.other_cores <= max_cores \
                or time.monotonic() >= deadline:
            return meter.other_cores


def _own_cpu(tree: bool = False) -> float:
    times = os.times()
    total = times.user + times.system
    if tree:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                cpu = child.cpu_times()
                total += cpu.user + cpu.system
            except psutil.Error:
                pass
    return total


def _machine_busy() -> float | None:
    """Seconds of busy CPU time since boot, all cores (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    # guest time is already in user/nice
    busy = sum(values[:8]) - idle if len(values) >= 8 else sum(values) - idle
    return busy / os.sysconf("SC_CLK_TCK")


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages (others' engines share this machine)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None

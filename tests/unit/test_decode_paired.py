# SPDX-License-Identifier: Apache-2.0
"""``decode_latency --paired``: the engines' windows in turn, rows and paired ratios."""

from __future__ import annotations

import pytest

from benchmarks.perf import decode_latency, decode_paired, decode_report, kv_math

SHAPE = kv_math.ModelShape(layers=16, kv_heads=2, head_dim=128, dtype_bytes=4)


def _args(*extra: str):
    return decode_latency.parse_args(["--preset", "gqa128", "--contexts", "256", "16384",
                                      "--batch-sizes", "1", "--paired", "--rounds", "3",
                                      *extra])


def test_paired_flags_and_sizing_count_every_round():
    args = _args()
    assert args.paired and args.rounds == 3
    assert not decode_latency.parse_args(["--preset", "gqa128"]).paired
    # Each request outlives every round of every window (sizing reads rounds as retries).
    _, max_tokens, _, _ = decode_latency.sizing("in-place", SHAPE,
                                                decode_paired._sizing_args(args))
    per_round = (args.warmup_steps + args.decode_steps) * len(args.alphas)
    assert max_tokens >= 3 * per_round


def test_prompts_are_the_same_in_every_engine_process():
    first = decode_paired.prompts_of(256, 2)
    assert first == decode_paired.prompts_of(256, 2)
    assert len(first) == 2 and all(len(p) == 256 for p in first) and first[0] != first[1]
    assert decode_paired.prompts_of(256, 1)[0] != first[0]  # per point, not global


def test_paired_speedups_are_round_by_round_ratios():
    rounds = {"dense": [50.0, 60.0, 40.0], "infinigen": [25.0, 40.0, 40.0],
              "infinigen, alpha 10000": [50.0, 30.0, 20.0]}
    out = decode_paired.paired_speedups(rounds)
    assert set(out) == {"infinigen", "infinigen, alpha 10000"}
    assert out["infinigen"] == {"median": pytest.approx(1.5), "low": pytest.approx(1.0),
                                "high": pytest.approx(2.0)}
    assert out["infinigen, alpha 10000"]["median"] == pytest.approx(2.0)
    assert decode_paired.paired_speedups({"infinigen": [1.0]}) == {}  # no dense: none


def _window(times_ms, start_generated=1, delta=None, other=0.0):
    return {"times": [t / 1000 for t in times_ms], "got": [1] * len(times_ms),
            "delta": delta or {}, "start_generated": start_generated, "other_cores": other}


def test_a_row_joins_every_rounds_steps_and_keeps_each_rounds_median():
    args = _args()
    windows = [_window([10, 12, 11], start_generated=1, other=0.1),
               _window([20, 22, 21], start_generated=40, other=0.3)]
    row = decode_paired._row(("dense", None, "default"), windows, 256, 1, 1.5, SHAPE, args)
    assert row["config"] == "dense" and row["steps"] == 6
    assert row["decode_ms_per_step"] == pytest.approx(16.0)  # median of all six
    assert row["round_ms"] == pytest.approx([11.0, 21.0])
    assert row["other_cores_busy"] == 0.3 and row["all_steps_full_batch"]
    # Mean context over the windows: 256 + start - 1 + (3 - 1) / 2.
    assert row["mean_context"] == pytest.approx(256 + (0 + 39) / 2 + 1)
    selected = {"selected_tokens": 30.0, "candidate_tokens": 300.0}
    sparse = decode_paired._row(("in-place", "infinigen", "10000"),
                                [_window([5, 5, 5], delta=selected),
                                 _window([6, 6, 6], delta=selected)], 256, 1, 1.5, SHAPE, args)
    assert sparse["config"] == "infinigen, alpha 10000"
    assert sparse["selected_fraction"] == pytest.approx(0.1)  # the deltas summed


def test_the_report_lists_the_rounds_and_the_paired_speedup():
    args = _args()
    dense = decode_paired._row(("dense", None, "default"), [_window([50]), _window([60])],
                               16384, 1, 1.0, SHAPE, args)
    sparse = decode_paired._row(("in-place", "infinigen", "default"),
                                [_window([25]), _window([40])], 16384, 1, 1.0, SHAPE, args)
    speedup = decode_paired.paired_speedups({"dense": dense["round_ms"],
                                             "infinigen": sparse["round_ms"]})["infinigen"]
    dense.update(paired_speedup=None, paired_speedup_range=None)
    sparse.update(paired_speedup=speedup["median"],
                  paired_speedup_range=[speedup["low"], speedup["high"]])
    text = "\n".join(decode_report.sections([dense, sparse], args, SHAPE))
    section = text.split("## Paired rounds")[1].split("\n## ")[0]
    assert "| 16384 | 1 | infinigen | 25.0 / 40.0 | 1.75 (1.50-2.00) | 0.57 |" in section
    assert "| 16384 | 1 | dense | 50.0 / 60.0 |  |  |" in section
    # Unpaired rows: no such section.
    assert "## Paired rounds" not in "\n".join(
        decode_report.sections([{k: v for k, v in r.items() if k != "round_ms"}
                                for r in (dense, sparse)], args, SHAPE))


def _exits(conn) -> None:
    raise SystemExit(3)


def test_an_engine_process_that_dies_is_named_with_its_exit_code():
    import multiprocessing

    handle = decode_paired._Engine.__new__(decode_paired._Engine)
    context = multiprocessing.get_context("spawn")
    handle.conn, child = context.Pipe()
    handle.process = context.Process(target=_exits, name="engine-dense", args=(child,))
    handle.process.start()
    child.close()
    with pytest.raises(RuntimeError, match=r"engine-dense exited \(code 3\) before answering "
                                           r"'ready'"):
        handle.answer("ready")
    handle.close()

"""The benchmark and tuner command lines: `python -m megatron_tokenweave.bench --help` lists
every command on one line and exits 0; every command (and the tuner) names itself as it is
run and has help for every option. No benchmark runs here."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys

import pytest

from megatron_tokenweave.bench import PROG
from megatron_tokenweave.bench.__main__ import COMMANDS


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "80"}, timeout=120)


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    return [action.dest for action in parser._actions
            if not action.help or action.help == argparse.SUPPRESS]


def test_bench_help_lists_every_command():
    done = _run("megatron_tokenweave.bench", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {PROG} "), done.stdout
    for name, summary in COMMANDS.items():
        assert re.search(rf"^ +{name} +{re.escape(summary)}$", done.stdout, re.M), name
    assert max(map(len, done.stdout.splitlines())) <= 80


def test_bench_refuses_an_unknown_command():
    done = _run("megatron_tokenweave.bench", "nope")
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr and "split_cost" in done.stderr


def test_bench_command_help_runs_through_the_dispatcher():
    done = _run("megatron_tokenweave.bench", "split_cost", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {PROG} split_cost "), done.stdout


@pytest.mark.parametrize("name", list(COMMANDS))
def test_bench_command_options_have_help(name):
    parser = importlib.import_module(f"megatron_tokenweave.bench.{name}").parser()
    assert parser.prog == f"{PROG} {name}"
    assert parser.description
    assert _undocumented(parser) == []


def test_bench_dispatcher_and_tuner_options_have_help():
    from megatron_tokenweave import tune
    from megatron_tokenweave.bench.__main__ import parser

    assert _undocumented(parser()) == []
    assert tune.parser().prog == "python -m megatron_tokenweave.tune"
    assert _undocumented(tune.parser()) == []
    assert "session" not in tune.parser().format_help()


def test_tuner_refuses_a_partial_custom_shape(capsys):
    from megatron_tokenweave import tune

    with pytest.raises(SystemExit) as exit_:
        tune.main(["--hidden", "1024", "--ffn", "4096"])
    assert exit_.value.code == 2
    assert "--heads and --kv-groups" in capsys.readouterr().err


def test_interleaved_timing_runs_iters_iterations_in_the_balanced_orders(monkeypatch):
    """interleaved_medians times exactly `iters` iterations (not rounded up to whole cycles:
    a tuner's 15 candidates would triple its time), iteration i in order i of the cycle, after
    `warmup` untimed rounds; each candidate's median is over its own samples."""
    from megatron_tokenweave.bench import timing

    clock = iter(range(10**6))

    class FakeEvent:  # elapsed_time: the order of the two records, so every sample is 1 ms
        def __init__(self, enable_timing: bool) -> None:
            self.t = 0

        def record(self) -> None:
            self.t = next(clock)

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: FakeEvent) -> float:
            return float(end.t - self.t)

    monkeypatch.setattr(timing.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    calls: list[tuple[str, int]] = []
    names = [f"impl{i}" for i in range(5)]
    candidates = {n: (lambda i, n=n: calls.append((n, i))) for n in names}
    got = timing.interleaved_medians(candidates, iters=7, warmup=2)
    assert got == {n: 1e3 for n in names}
    orders = timing.balanced_orders(names)
    assert calls[:10] == [(n, i) for i in range(2) for n in names]
    assert calls[10:] == [(n, i) for i in range(7) for n in orders[i % len(orders)]]
    assert timing.interleaved_medians({}, iters=3) == {}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_interleaved_timing_balances_places_and_predecessors(n):
    """interleaved_medians' orders: each runs every candidate once; over the cycle each
    candidate holds every place, and follows every other candidate, equally often."""
    from collections import Counter

    from megatron_tokenweave.bench.timing import balanced_orders

    names = [f"impl{i}" for i in range(n)]
    orders = balanced_orders(names)
    assert len(orders) == (2 * n if n % 2 else n)
    assert all(sorted(order) == names for order in orders)
    places = Counter((place, name) for order in orders for place, name in enumerate(order))
    assert len(places) == n * n and len(set(places.values())) == 1
    after = Counter(pair for order in orders for pair in zip(order[:-1], order[1:], strict=True))
    assert len(after) == n * (n - 1) and len(set(after.values())) <= 1
    assert balanced_orders([]) == []


def test_call_check_plot_draws_from_a_result(tmp_path):
    """The call-check benchmark's plot, from a result of its schema (synthetic rows)."""
    from megatron_tokenweave.bench import call_check

    rows = [dict(tp=tp, tokens=t, hidden=h, max_err=0.0, check_on_us=5.0 + 0.01 * t,
                 check_off_us=5.0, cost=0.002 * t / 256, costs=[0.001, 0.002 * t / 256, 0.003])
            for tp in (2, 4) for h in (4096, 8192) for t in (8, 64, 256)]
    path = tmp_path / "call_check.png"
    call_check._plot({"gpu": "test", "date": "2026-12-02", "rows": rows}, str(path))
    assert path.stat().st_size > 1000


def test_call_check_point_is_the_median_of_passes_captured_in_turn(monkeypatch):
    """A point's cost is the median of its passes' (every pass kept), and the passes capture
    the check-on and check-off graphs in alternating order."""
    from megatron_tokenweave.bench import call_check

    costs = iter([0.05, -0.01, 0.02, 0.30, 0.01])
    firsts = []

    def fake(world, tokens, hidden, iters, on_first=True):
        firsts.append(on_first)
        cost = next(costs)
        return dict(max_err=0.01 * len(firsts), check_on_us=10.0 * (1 + cost),
                    check_off_us=10.0, cost=cost)

    monkeypatch.setattr(call_check, "_measure", fake)
    row = call_check._point(4, 8, 4096, 40, 5)
    assert firsts == [True, False, True, False, True]
    assert row["costs"] == [0.05, -0.01, 0.02, 0.30, 0.01]
    assert row["cost"] == 0.02 and row["check_on_us"] == pytest.approx(10.2)
    assert row["max_err"] == pytest.approx(0.05) and (row["tp"], row["tokens"]) == (4, 8)


def test_call_check_refuses_no_passes():
    """A point needs at least one pass: zero is refused before any GPU work."""
    from megatron_tokenweave.bench import call_check

    with pytest.raises(SystemExit):
        call_check.main(["--passes", "0"])


def test_save_plot_keeps_the_figure_in_256_colours(tmp_path):
    """Plots are saved as palette PNGs (the committed results travel to the device machine):
    the figure's pixels survive (its size, colours beyond white) at under half the RGBA bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from megatron_tokenweave.bench.report import save_plot

    fig, ax = plt.subplots(figsize=(6, 3))
    for k in range(8):
        ax.plot(range(50), [(x * (k + 1)) % 17 for x in range(50)], marker="o", label=str(k))
    ax.legend()
    rgba, palette = tmp_path / "rgba.png", tmp_path / "palette.png"
    fig.savefig(rgba, dpi=100)
    save_plot(fig, str(palette), dpi=100)
    plt.close(fig)
    im = Image.open(palette)
    assert im.mode == "P" and im.size == Image.open(rgba).size
    assert len(im.convert("RGB").getcolors(256)) > 8
    assert palette.stat().st_size < 0.5 * rgba.stat().st_size


def test_dump_result_puts_a_row_a_line_and_reads_back_equal():
    """Result files: the fields indented, each row of a list of rows on one line, and json.load
    gives back exactly what was written (nested values, floats, strings with newlines)."""
    import io
    import json

    from megatron_tokenweave.bench.report import dump_result

    rows = [{"impl": f"k{i}", "us": 1.0 / (i + 3), "tiles": None, "note": "a\nb"}
            for i in range(5)]
    result = {"gpu": "X", "date": "2026-12-07", "nested": {"a": [1, 2], "b": {"c": 0.1}},
              "empty": [], "rows": rows, "overlap": [{"x": [1, {"y": 2}]}]}
    buf = io.StringIO()
    dump_result(result, buf)
    text = buf.getvalue()
    assert json.loads(text) == result
    lines = [line.rstrip(",") for line in text.splitlines()]
    for r in rows:
        assert "  " + json.dumps(r) in lines
    assert len(text) < len(json.dumps(result, indent=1))


@pytest.mark.parametrize("te", [True, False])
def test_fp8_rows_plot_draws_from_a_result(tmp_path, te):
    """The FP8-rows benchmark's plot, from a result of its schema (synthetic rows), with and
    without TE's rows (a run where TransformerEngine does not import leaves them None)."""
    from megatron_tokenweave.bench import fp8_rows

    rows = [dict(tp=tp, tokens=t, hidden=h, scaling=s, ctas=16, op_us=10.0 + 0.01 * t,
                 fused_us=10.2 + 0.01 * t, separate_us=14.0 + 0.012 * t if te else None,
                 te_norm_quantize_us=9.0 if te else None, cost=0.02,
                 vs_separate=0.75 if te else None)
            for tp in (2, 4) for h in (4096, 8192) for t in (1024, 3001) for s in fp8_rows.SCALINGS]
    path = tmp_path / "fp8_rows.png"
    fp8_rows._plot({"gpu": "test", "date": "2026-12-03", "rows": rows}, str(path))
    assert path.stat().st_size > 1000


@pytest.mark.parametrize("argv, words", [
    (["fp8_rows", "--hidden", "4104"], "multiples of 128"),
    (["split_cost", "--fp8-recipe", "tensorwise", "--tokens", "1000"],
     "--tokens must be multiples of 32"),
    (["block", "--fp8-recipe", "delayed", "--local"], "not with --local"),
    (["e2e", "--fp8-recipe", "blockwise", "--local"], "not with --local"),
    (["block", "--fp8-recipe", "tensorwise"], "needs TransformerEngine"),
    (["e2e", "--fp8-recipe", "delayed"], "needs TransformerEngine"),
    (["kernel", "--fp8-recipe", "blockwise"], "needs TransformerEngine"),
    (["kernel", "--fp8-recipe", "mxfp8"], "invalid choice"),
])
def test_fp8_benchmark_arguments_are_checked_before_anything_runs(argv, words):
    """Bad FP8 arguments end the command with the reason (this CPU machine has no TE)."""
    done = _run("megatron_tokenweave.bench", *argv)
    assert done.returncode != 0 and words in done.stderr, done.stderr


def test_fused_fp8_scalings_cover_the_woven_recipes():
    """The fused op writes the next linear's rows for every woven recipe but current scaling
    (tensorwise), whose scale needs the whole call's amax: the FP8 benchmarks' rows follow."""
    from megatron_tokenweave.bench.fp8_rows import RECIPE_SCALING, SCALINGS
    from megatron_tokenweave.precision import WOVEN_FP8_RECIPES

    assert set(RECIPE_SCALING) | {"tensorwise"} == set(WOVEN_FP8_RECIPES)
    assert set(RECIPE_SCALING.values()) == set(SCALINGS)

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


def test_interleaved_timing_gives_every_candidate_every_place():
    """interleaved_medians' order: over n iterations each of n candidates runs once in each
    place, and each iteration runs every candidate once."""
    from megatron_tokenweave.bench.timing import rotation

    names = ["cublas", "tokenweave", "te", "cutlass"]
    orders = [rotation(names, i) for i in range(len(names))]
    assert all(sorted(order) == sorted(names) for order in orders)
    for place in range(len(names)):
        assert sorted(order[place] for order in orders) == sorted(names)
    assert rotation(names, len(names)) == names
    assert rotation([], 3) == []

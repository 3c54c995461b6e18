"""The launcher (`launch.spawn`) keeps its ranks together: a rank that raises or dies takes the
others down at once with a message naming it; SIGTERM to the launcher, or a terminal's Ctrl-C
(SIGINT to its process group), stops every rank, frees their port and exits 0 with one line;
a launcher killed outright takes its ranks with it; whether the ranks are spawned or forked by a
fork server (the CPU tests' way). Small rank functions, no model: seconds."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _serving import _alive, _port_free

from megatron_tokenweave.launch import RankFailed, free_port, spawn, stop_event

STOP_LIMIT_S = 5.0
TESTS = os.path.dirname(os.path.abspath(__file__))
# Both ways of starting ranks: spawned (a fresh interpreter each), or forked by a fork server
# that preloaded a module (the CPU tests' way, tests/_dist.py).
STARTS = pytest.mark.parametrize("preload", [(), ("torch",)], ids=["spawned", "forked"])


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _pid_files(tmp: str, world: int = 2) -> list[Path]:
    return [Path(tmp) / f"rank{r}.pid" for r in range(world)]


def _pids(tmp: str) -> list[int]:
    return [int(p.read_text()) for p in _pid_files(tmp)]


def _started(rank: int, tmp: str) -> None:
    """Record this rank's pid; rank 1 waits until rank 0 runs too."""
    _pid_files(tmp)[rank].write_text(str(os.getpid()))
    if rank == 1:
        _wait_for(_pid_files(tmp)[0].exists, 60, "rank 0")


def _fail(rank: int, world: int, tmp: str, how: str) -> None:
    """Rank 1 fails (`how`); rank 0 hangs, as a rank in a collective with a dead peer does."""
    _started(rank, tmp)
    if rank == 0:
        time.sleep(3600)
    (Path(tmp) / "failed_at").write_text(repr(time.time()))
    if how == "raise":
        raise ValueError("boom")
    if how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


@STARTS
@pytest.mark.parametrize(("how", "message"), [
    ("raise", "rank 1 failed: ValueError: boom\nTraceback"),
    ("exit", "rank 1 failed: exited with code 3 without reporting"),
    ("kill", "rank 1 failed: killed by SIGKILL without reporting"),
])
def test_failed_rank_takes_the_others_down(tmp_path, how, message, preload):
    """The error names the rank and what happened to it; it comes at once (not after a
    timeout), and the hanging rank is gone when it comes."""
    with pytest.raises(RankFailed) as failure:
        spawn(_fail, 2, str(tmp_path), how, preload=preload)
    raised_at = time.time()
    assert failure.value.rank == 1
    assert str(failure.value).startswith(message), str(failure.value)
    assert raised_at - float((tmp_path / "failed_at").read_text()) < 2.0
    assert not any(_alive(pid) for pid in _pids(str(tmp_path)))


def _tensors(rank: int, world: int) -> dict:
    """A result holding tensors (as the multi-rank tests return logits); the rank exits at once."""
    g = torch.Generator().manual_seed(rank)
    return {"logits": torch.randn(256, 1024, generator=g), "rank": torch.tensor([rank])}


@STARTS
def test_tensor_results_are_the_launchers_own_copies(preload):
    """A rank's tensors arrive whole and as the launcher's own memory: never storage shared
    through a descriptor the rank serves, which fails to open once that rank has exited."""
    results = spawn(_tensors, 4, preload=preload)
    for rank, out in enumerate(results):
        want = torch.randn(256, 1024, generator=torch.Generator().manual_seed(rank))
        assert torch.equal(out["logits"], want) and out["rank"].item() == rank
        assert not out["logits"].is_shared()


def _environment(rank: int, world: int, name: str) -> str | None:
    return os.environ.get(name)


def test_forked_ranks_get_the_launchers_environment_of_the_call(monkeypatch):
    """A fork server keeps the environment it started with; each call's ranks still see the
    launcher's environment as it is at that call."""
    spawn(_environment, 2, "TOKENWEAVE_TEST_VALUE", preload=("torch",))  # the server runs
    for value in ("first", "second"):
        monkeypatch.setenv("TOKENWEAVE_TEST_VALUE", value)
        assert spawn(_environment, 2, "TOKENWEAVE_TEST_VALUE", preload=("torch",)) == [value] * 2
    monkeypatch.delenv("TOKENWEAVE_TEST_VALUE")
    assert spawn(_environment, 2, "TOKENWEAVE_TEST_VALUE", preload=("torch",)) == [None] * 2


def test_forked_ranks_are_refused_for_nccl():
    with pytest.raises(ValueError, match="preload is for gloo ranks on CPU"):
        spawn(_environment, 2, "PATH", backend="nccl", preload=("torch",))


def _serve_port(rank: int, world: int, port: int, tmp: str) -> None:
    """A server's shape: rank 0 listens on `port`; every rank runs until asked to stop."""
    stop = stop_event()
    with socket.socket() as listener:
        if rank == 0:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen()
        _started(rank, tmp)
        stop.wait()


LAUNCHER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_launch_cpu import _serve_port
    from megatron_tokenweave.launch import Stopped, spawn
    try:
        spawn(_serve_port, 2, {port}, {tmp!r}, timeout=None, preload={preload!r})
    except Stopped as stop:
        print(f"launcher: {{stop}}")
""")


@STARTS
@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "SIGINT to its process group",
                                 "SIGKILL to the launcher"])
def test_launcher_stop_leaves_nothing_behind(tmp_path, how, preload):
    """Within STOP_LIMIT_S of the signal every rank is gone and the port is free; on SIGTERM or
    Ctrl-C the launcher exits 0 with one line and no stack dump."""
    port = free_port()
    code = LAUNCHER.format(tests=TESTS, port=port, tmp=str(tmp_path), preload=preload)
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(lambda: all(p.exists() for p in _pid_files(str(tmp_path))), 120, "the ranks")
        ranks = _pids(str(tmp_path))
        assert not _port_free(port)
        start = time.monotonic()
        if how.startswith("SIGINT"):
            os.killpg(launcher.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        else:
            launcher.send_signal(signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGKILL)
        _wait_for(lambda: not any(map(_alive, ranks)) and _port_free(port), STOP_LIMIT_S,
                  "the ranks to go and the port to be free")
        assert time.monotonic() - start < STOP_LIMIT_S
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    if how.startswith("SIGKILL"):
        assert launcher.returncode == -signal.SIGKILL
        return
    name = how.split()[0]
    assert launcher.returncode == 0, err
    assert out == f"launcher: stopped by {name}\n"
    assert "Traceback" not in err and "Stack (most recent call first)" not in err, err

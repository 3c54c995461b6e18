"""A soak of the Flask text generation server on CPU (2 gloo ranks, static engine), started the
way a user starts it (examples/serve.py's launcher, here with an engine fault armed:
tests/_serving.py): concurrent clients send, paced over SOAK_S seconds, a mix of valid
requests, every kind of bad request and requests that fail inside the engine; the server must
answer every one as it should, every valid reply as the stock model's server answers it, still
answer at the end, and stop cleanly on SIGTERM (and the stock one on SIGINT).

Bounded: SOAK_REQUESTS requests to the soaked server in about SOAK_S seconds, on 127.0.0.1.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from _serving import (
    REPO,
    SOAK_REQUESTS,
    SOAK_S,
    ServerProcess,
    Soak,
    bad_requests,
    check_bad_answer,
    check_fault_answer,
    child_env,
    engine_fault_request,
    http,
)

STOP_LIMIT_S = 5.0  # every rank gone and the port free within this after the signal
MAX_BATCH, MAX_SEQ, WORKSPACE = 4, 96, 128
SERVER_OPTIONS = ("--max-batch", str(MAX_BATCH), "--max-seq", str(MAX_SEQ), "--layers", "2",
                  "--hidden", "64")


def _request(method: str, path: str, body: dict) -> tuple[str, str, bytes]:
    return method, path, json.dumps(body).encode()


# Deterministic requests (greedy, or sampled with a seed), so the stock server's replies are
# the reference for every one of them.
VALID = [
    _request("PUT", "/api", {"prompts": ["The quick brown fox"], "tokens_to_generate": 8,
                             "top_k": 1}),
    _request("PUT", "/api", {"prompts": ["tensor", "parallel"], "tokens_to_generate": 6,
                             "top_k": 1}),
    _request("PUT", "/api", {"prompts": ["score me", "and me too"], "tokens_to_generate": 0,
                             "logprobs": True}),
    _request("POST", "/completions", {"prompt": "Hello", "max_tokens": 8, "temperature": 0}),
    _request("POST", "/completions", {"prompt": ["Weave", "tokens"], "max_tokens": 6,
                                      "top_k": 1, "top_p": 0}),
    _request("POST", "/completions", {"prompt": "Sampled", "max_tokens": 8, "temperature": 0.8,
                                      "top_p": 0.9, "seed": 7}),
    _request("POST", "/completions", {"prompt": "Top-k", "max_tokens": 8, "temperature": 0.7,
                                      "top_k": 5, "top_p": 0, "seed": 11}),
    _request("POST", "/completions", {"prompt": "echo", "max_tokens": 0, "echo": True,
                                      "logprobs": 3}),
]
# Bad requests, plus one whose first forward would overflow the TokenWeave workspace
# (TOKENWEAVE_MAX_TOKENS=WORKSPACE for the soaked server: 4 prompts x 40 tokens).
BAD = bad_requests(MAX_BATCH, MAX_SEQ) + [
    (_request("PUT", "/api", {"prompts": ["x" * 40] * 4, "tokens_to_generate": 4}), "prompts"),
]


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> dict:
    """Start a stock and a TokenWeave server, take the stock replies to VALID, stop the stock
    server with SIGINT, soak the TokenWeave server, send VALID once more, stop it with SIGTERM."""
    logs = str(tmp_path_factory.mktemp("soak"))
    stock = ServerProcess(0, logs, "--spec", "stock", *SERVER_OPTIONS)
    woven = ServerProcess(0, logs, "--spec", "tokenweave", *SERVER_OPTIONS,
                          env={"TOKENWEAVE_MAX_TOKENS": str(WORKSPACE)})
    try:
        stock.wait_ready()
        expected = [http(stock.url + path, method, body) for method, path, body in VALID]
        stock_stop = stock.stop(signal.SIGINT, STOP_LIMIT_S)
        woven.wait_ready()
        start = time.monotonic()
        replies = Soak(woven.url, VALID, BAD, SOAK_S, SOAK_REQUESTS - len(VALID),
                       fault=engine_fault_request()).run()
        final = [http(woven.url + path, method, body) for method, path, body in VALID]
        served_s = time.monotonic() - start
        woven_stop = woven.stop(signal.SIGTERM, STOP_LIMIT_S)
    finally:
        stock.kill()
        woven.kill()
    return dict(expected=expected, replies=replies, final=final, served_s=served_s,
                stops=[(stock, signal.SIGINT, stock_stop), (woven, signal.SIGTERM, woven_stop)])


def test_soak_every_reply_is_right(soak):
    """Every valid reply equals the stock server's, every bad request got 400 with a JSON error
    naming its field, every engine-fault request 500 with a JSON error, and nothing else was a
    500: the engine kept serving after each fault."""
    assert all(status == 200 for status, _ in soak["expected"]), soak["expected"]
    replies = soak["replies"]
    assert len(replies) == SOAK_REQUESTS - len(VALID)
    kinds = {kind: [r for r in replies if r.kind == kind] for kind in ("valid", "bad", "fault")}
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}
    for reply in kinds["valid"]:
        assert (reply.status, reply.reply) == soak["expected"][reply.index], reply
    for reply in kinds["bad"]:
        check_bad_answer(BAD[reply.index], (reply.status, reply.reply))
    for reply in kinds["fault"]:
        check_fault_answer((reply.status, reply.reply))
    first_fault = min(r.sent_s for r in kinds["fault"])
    assert any(r.sent_s > first_fault for r in kinds["valid"])


def test_soak_server_answers_to_the_end(soak):
    """The server answered for at least SOAK_S seconds and, at the end, every valid request
    exactly as the stock server did."""
    assert soak["served_s"] >= SOAK_S
    assert soak["final"] == soak["expected"]


def test_soak_servers_stop_cleanly(soak):
    """SIGINT (the stock server) and SIGTERM (the soaked one) to the launcher: every rank gone
    and the port free within STOP_LIMIT_S, exit status 0, one line on stdout and no stack dump
    after the signal."""
    for server, signum, (elapsed, out, err) in soak["stops"]:
        name = signal.Signals(signum).name
        assert elapsed < STOP_LIMIT_S, (name, elapsed)
        assert server.proc.returncode == 0, (name, server.proc.returncode, err[-2000:])
        assert out.splitlines() == [f"serve.py: stopped by {name}; all 2 ranks exited"], out
        assert "Traceback" not in err and "Stack (most recent call first)" not in err, err


def test_soak_servers_bound_ports_the_system_chose(soak):
    """Port 0: each launcher printed the port the system gave its Flask server, and served on
    it (no port picked beforehand that another socket could take first)."""
    stock, woven = (server for server, _, _ in soak["stops"])
    assert stock.port > 0 and woven.port > 0 and stock.port != woven.port
    assert f"on {woven.url} (/api, /completions)" in woven.output()[0]


def test_openai_server_refuses_port_zero():
    """Megatron's OpenAI frontends bind in forked processes and report no chosen port, so
    examples/serve.py refuses --port 0 there, before starting any rank."""
    done = subprocess.run([sys.executable, "examples/serve.py", "--server", "openai",
                           "--port", "0"], cwd=REPO, env=child_env(None), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "--server openai needs a port" in done.stderr, done.stderr

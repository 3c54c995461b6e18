"""Helpers for the serving tests: an HTTP client, the requests a server must answer (good, bad,
one that fails inside the engine), an in-process server session per engine, a soak driver, and
a server process (`python tests/_serving.py [examples/serve.py options]`: examples/serve.py with
an engine fault armed, see `arm_engine_fault`)."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POISON = 7  # a prompt with this byte (BEL) fails inside the engine: arm_engine_fault
SOAK_S = 90.0  # a soak's length
SOAK_REQUESTS = 200  # to the soaked server, the final round of valid requests included
Request = tuple[str, str, bytes]  # (method, path, raw body)
_SERVING = re.compile(r"^serving the .* on http://127\.0\.0\.1:(\d+) ", re.MULTILINE)


def http(url: str, method: str, body: bytes | None,
         timeout: float = 300.0) -> tuple[int, dict | str]:
    """(status, parsed JSON or text) of one request; HTTP errors are answers too."""
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _dumps(body: Any) -> bytes:
    return json.dumps(body).encode()


def bad_requests(max_batch: int, max_seq: int) -> list[tuple[Request, str | None]]:
    """Requests the guard must refuse with HTTP 400, each with the field its error must name
    (None: the body itself). The first is the one that used to break the server for good
    (/completions defaults top_p to 1.0, and Megatron asserts on top_k with top_p)."""
    api = lambda body: ("PUT", "/api", _dumps(body))  # noqa: E731
    completions = lambda body: ("POST", "/completions", _dumps(body))  # noqa: E731
    return [
        (completions({"prompt": "Hello", "max_tokens": 4, "top_k": 1}), "top_k"),
        (api({"prompts": ["Hello"], "top_k": -1}), "top_k"),
        (api({"prompts": ["Hello"], "top_k": 2000}), "top_k"),
        (api({"prompts": ["Hello"], "top_k": 5, "top_p": 0.5}), "top_k"),
        (api({"prompts": ["Hello"], "temperature": 0}), "temperature"),
        (api({"prompts": ["Hello"], "temperature": "hot"}), "temperature"),
        (api({"prompts": ["Hello"], "top_p": 1}), "top_p"),
        (api({"prompts": ["Hello"], "tokens_to_generate": 0}), "tokens_to_generate"),
        (api({"prompts": ["x"], "tokens_to_generate": -1}), "tokens_to_generate"),
        (api({"prompts": "Hello"}), "prompts"),
        (api({"prompts": []}), "prompts"),
        (api({"prompts": [""]}), "prompts"),
        (api({"prompts": ["x"], "tokens_to_generate": max_seq}), "prompts"),
        (api({"prompts": ["x" * (max_seq + 1)], "tokens_to_generate": 1}), "prompts"),
        (api({"prompts": ["x"] * (max_batch + 1)}), "prompts"),
        (api({"prompts": ["x"], "random_seed": 3}), "random_seed"),
        (("PUT", "/api", b"{not json"), None),
        (completions({"prompt": "x"}), "max_tokens"),
        (completions({"prompt": "x", "max_tokens": 10 * max_seq}), "prompt"),
        (completions({"prompt": "x", "max_tokens": 4, "temperature": "hot"}), "temperature"),
        (completions({"prompt": "x", "max_tokens": 4, "temperature": -1}), "temperature"),
        (completions({"prompt": "x", "max_tokens": 4, "top_k": 256, "top_p": 0}), "top_k"),
        (completions({"prompt": "x", "max_tokens": 0}), "max_tokens"),
        (completions({"prompt": "x", "max_tokens": 4, "logprobs": 2}), "logprobs"),
        (completions({"prompt": "x", "max_tokens": 4, "n": 2}), "n"),
        (completions({"prompt": "x", "max_tokens": 4, "seed": 0}), "seed"),
        (completions({"prompt": "x", "max_tokens": 4, "debug_fname": "../x"}), "debug_fname"),
        (completions({"prompt": [[1, 2]], "max_tokens": 1}), "prompt"),
        (("POST", "/completions", b"prompt=x&max_tokens=4"), None),
    ]


def engine_fault_request(tokens: int = 4) -> Request:
    """A request the guard accepts and the engine fails on (arm_engine_fault): HTTP 500."""
    return "PUT", "/api", _dumps({"prompts": [f"{chr(POISON)} boom"],
                                  "tokens_to_generate": tokens, "top_k": 1})


def arm_engine_fault(model: Any) -> None:
    """Make `model` raise inside its last decoder layer, on every rank alike, in a prefill (a
    forward of several positions: prompt tokens only, never generated ones) whose input holds
    the POISON byte: an error in the middle of the engine's first forward, after the earlier
    layers' collectives ran."""
    poisoned = [False]

    def look(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        poisoned[0] = ids is not None and ids.shape[-1] > 1 and bool((ids == POISON).any())

    def fail(_module, _args):
        if poisoned[0]:
            raise RuntimeError("injected engine fault")

    model.embedding.register_forward_pre_hook(look, with_kwargs=True)
    model.decoder.layers[-1].register_forward_pre_hook(fail)


def serve_and_query(engine, port: int, prompts: list[str], new_tokens: int, max_batch: int,
                    max_seq: int) -> dict | None:
    """Serve `engine` (its model armed with arm_engine_fault) on every rank (FlaskTextServer);
    rank 0 sends a greedy /api request, the bad requests, a request that fails inside the
    engine, the /api request again and a greedy /completions request, then shuts the server
    down and returns the answers (other ranks return None)."""
    import torch.distributed as dist

    from megatron_tokenweave.serving.http import FlaskTextServer

    server = FlaskTextServer(engine, port=port)
    if dist.get_rank() != 0:
        server.serve_forever()
        return None
    server.start()
    try:
        good = _dumps(dict(prompts=prompts[:-1], tokens_to_generate=new_tokens, top_k=1))
        answers = {"api": http(server.url + "/api", "PUT", good)}
        answers["bad"] = [http(server.url + path, method, body)
                          for (method, path, body), _ in bad_requests(max_batch, max_seq)]
        method, path, body = engine_fault_request()
        answers["fault"] = http(server.url + path, method, body)
        answers["after_fault"] = http(server.url + "/api", "PUT", good)
        completion = _dumps(dict(prompt=prompts[-1], max_tokens=new_tokens, temperature=0))
        answers["completions"] = http(server.url + "/completions", "POST", completion)
    finally:
        server.shutdown()
    return answers


def check_bad_answer(request: tuple[Request, str | None], answer: tuple[int, Any]) -> None:
    """HTTP 400 with a JSON error that names the field."""
    (method, path, body), field_name = request
    status, reply = answer
    assert status == 400, (method, path, body, status, reply)
    assert isinstance(reply, dict) and reply.get("error"), (body, reply)
    assert reply.get("field") == field_name, (body, reply)
    if field_name is not None:
        assert field_name in reply["error"], (body, reply)


def check_fault_answer(answer: tuple[int, Any]) -> None:
    """HTTP 500 with a JSON error that says the engine failed."""
    status, reply = answer
    assert status == 500 and isinstance(reply, dict), answer
    assert "engine failed" in reply["error"] and "injected engine fault" in reply["error"], reply


def check_server_answers(stock: dict, woven: dict, engine_tokens: list[list[int]],
                         prompts: list[str], max_batch: int, max_seq: int) -> None:
    """Assert what both serving tests require of the answers of serve_and_query."""
    for key in ("api", "after_fault", "completions"):
        assert stock[key][0] == 200 and woven[key][0] == 200, (key, stock[key], woven[key])
    assert woven["api"][1]["tokens"] == stock["api"][1]["tokens"]
    assert woven["api"][1]["text"] == stock["api"][1]["text"]
    assert woven["completions"][1] == stock["completions"][1]
    api_tokens = woven["api"][1]["tokens"]
    for prompt, tokens, generated in zip(prompts, api_tokens, engine_tokens, strict=False):
        assert tokens[: len(prompt.encode())] == list(prompt.encode())
        assert tokens[len(prompt.encode()):][: len(generated)] == generated
    for answers in (stock, woven):
        for request, answer in zip(bad_requests(max_batch, max_seq), answers["bad"], strict=True):
            check_bad_answer(request, answer)
        check_fault_answer(answers["fault"])
        # The failed request left the engine: the next one is answered as by a fresh server.
        assert answers["after_fault"] == answers["api"]


# ------------------------------------------------------------------------------------ soak
@dataclass
class SoakReply:
    kind: str  # "valid", "bad" or "fault"
    index: int  # into the valid or bad list
    status: int
    reply: Any
    sent_s: float  # seconds after the soak started


@dataclass
class Soak:
    """Concurrent clients sending a fixed mix of valid, bad and (with `fault`) engine-fault
    requests, paced so that `requests` are spread over `duration_s`."""

    url: str
    valid: list[Request]
    bad: list[tuple[Request, str | None]]
    duration_s: float
    requests: int
    fault: Request | None = None  # every fault_every-th request
    fault_every: int = 25
    clients: int = 4
    replies: list[SoakReply] = field(default_factory=list)

    def _request(self, k: int) -> tuple[str, int, Request]:
        if self.fault is not None and k % self.fault_every == self.fault_every // 2:
            return "fault", 0, self.fault
        if k % 3 == 2:
            i = (k // 3) % len(self.bad)
            return "bad", i, self.bad[i][0]
        i = k % len(self.valid)
        return "valid", i, self.valid[i]

    def run(self) -> list[SoakReply]:
        """Send every request (request k at duration_s * k / requests); the replies in order."""
        start = time.monotonic()
        lock = threading.Lock()
        counter = iter(range(self.requests))

        def client() -> None:
            while True:
                with lock:
                    k = next(counter, None)
                if k is None:
                    return
                time.sleep(max(0.0, start + self.duration_s * k / self.requests
                               - time.monotonic()))
                kind, index, (method, path, body) = self._request(k)
                sent = time.monotonic() - start
                status, reply = http(self.url + path, method, body, timeout=60)
                with lock:
                    self.replies.append(SoakReply(kind, index, status, reply, sent))

        threads = [threading.Thread(target=client) for _ in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.replies.sort(key=lambda r: r.sent_s)
        return self.replies


# -------------------------------------------------------------------------- server process
def _serve_armed(rank: int, world: int, args: Any) -> None:
    import serve  # examples/ is on the path the launcher passed on

    serve.run(rank, world, args, prepare=arm_engine_fault)


def child_env(extra: dict[str, str] | None) -> dict[str, str]:
    """The test's environment for a script of the repository run as a file: the repository on
    PYTHONPATH, so the package imports however it was installed (the script's own folder, not
    the working directory, starts its path)."""
    paths = [REPO, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **(extra or {})}


class ServerProcess:
    """examples/serve.py's launcher (SIGINT/SIGTERM handling, one line on a stop) serving a model
    armed with arm_engine_fault, in its own session like a command started from a shell; its
    output goes to `log_dir`/server-N.{out,err}. Port 0 (the Flask server): the system picks,
    and `wait_ready` reads the port from the launcher's "serving ... on URL" line."""

    _started = itertools.count()

    def __init__(self, port: int, log_dir: str, *options: str,
                 env: dict[str, str] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        n = next(self._started)
        self.paths = [os.path.join(log_dir, f"server-{n}.{ext}") for ext in ("out", "err")]
        with open(self.paths[0], "w") as out, open(self.paths[1], "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--port", str(port), *options],
                stdout=out, stderr=err, cwd=REPO, env=child_env(env), start_new_session=True)

    def output(self) -> tuple[str, str]:
        """(stdout, stderr) so far."""
        texts = []
        for path in self.paths:
            with open(path, errors="replace") as f:
                texts.append(f.read())
        return texts[0], texts[1]

    def ranks(self) -> list[int]:
        """Pids of the launcher's rank processes."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", "spawn_main"],
                             capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Until the port takes connections (or the process dies: then fail with its output)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}):\n"
                                     f"{self.output()}")
            if self.port == 0 and (bound := _SERVING.search(self.output()[0])):
                self.port = int(bound.group(1))
                self.url = f"http://127.0.0.1:{self.port}"
            if self.port == 0:
                time.sleep(0.5)
                continue
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.5)
        raise AssertionError(f"the server did not start within {timeout} s")

    def stop(self, signum: int, limit_s: float) -> tuple[float, str, str]:
        """Send `signum` to the launcher (SIGINT to its process group, as a terminal's Ctrl-C
        does); (seconds until every rank was gone and the port free, polled up to limit_s + 10
        s; the stdout and stderr written after the signal)."""
        ranks = self.ranks()
        assert ranks, "no rank processes"
        before = [len(text) for text in self.output()]
        start = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)
        while time.monotonic() - start < limit_s + 10.0:
            if not any(_alive(pid) for pid in ranks) and _port_free(self.port):
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - start
        self.proc.wait(timeout=60)
        out, err = self.output()
        return elapsed, out[before[0]:], err[before[1]:]

    def kill(self) -> None:
        """Leave nothing behind (a test that failed half-way; the ranks die with the launcher)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def _port_free(port: int) -> bool:
    """A new server could listen on `port` (as servers do, with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(REPO, "examples"))
    import _serving  # the rank function by this module's name: spawn pickles it by reference
    import serve

    serve.main(sys.argv[1:], rank_fn=_serving._serve_armed)

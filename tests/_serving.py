"""Helpers for the serving tests: an HTTP client and one server session per engine."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def http(url: str, method: str, body: bytes) -> tuple[int, dict | str]:
    """(status, parsed JSON or text) of one request; HTTP errors are answers too."""
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def bad_requests(max_batch: int, max_seq: int) -> list[tuple[str, str, bytes]]:
    """(method, path, raw body) of malformed requests the server must refuse with HTTP 400."""
    dumps = lambda body: json.dumps(body).encode()  # noqa: E731
    return [
        ("PUT", "/api", b"{not json"),
        ("PUT", "/api", dumps({"prompts": []})),
        ("PUT", "/api", dumps({"prompts": [""]})),
        ("PUT", "/api", dumps({"prompts": "not a list"})),
        ("PUT", "/api", dumps({"prompts": ["x"], "tokens_to_generate": -1})),
        ("PUT", "/api", dumps({"prompts": ["x"], "tokens_to_generate": max_seq})),
        ("PUT", "/api", dumps({"prompts": ["x" * (max_seq + 1)], "tokens_to_generate": 1})),
        ("PUT", "/api", dumps({"prompts": ["x"] * (max_batch + 1)})),
        ("POST", "/completions", dumps({"prompt": "x"})),
        ("POST", "/completions", dumps({"prompt": "x", "max_tokens": 10 * max_seq})),
        ("POST", "/completions", dumps({"prompt": "x", "max_tokens": 4, "temperature": "hot"})),
        ("POST", "/completions", b"prompt=x&max_tokens=4"),
    ]


def serve_and_query(engine, port: int, prompts: list[str], new_tokens: int, max_batch: int,
                    max_seq: int) -> dict | None:
    """Serve `engine` on every rank (FlaskTextServer); rank 0 sends a greedy /api request, the
    malformed requests, the /api request again and a greedy /completions request, then shuts the
    server down and returns the answers (other ranks return None)."""
    import torch.distributed as dist

    from megatron_tokenweave.serving.http import FlaskTextServer

    server = FlaskTextServer(engine, max_batch, max_seq, port=port)
    if dist.get_rank() != 0:
        server.serve_forever()
        return None
    server.start()
    try:
        good = json.dumps(dict(prompts=prompts[:-1], tokens_to_generate=new_tokens, top_k=1))
        answers = {"api": http(server.url + "/api", "PUT", good.encode())}
        answers["bad"] = [http(server.url + path, method, body)
                          for method, path, body in bad_requests(max_batch, max_seq)]
        answers["after_bad"] = http(server.url + "/api", "PUT", good.encode())
        completion = json.dumps(dict(prompt=prompts[-1], max_tokens=new_tokens, temperature=0))
        answers["completions"] = http(server.url + "/completions", "POST", completion.encode())
    finally:
        server.shutdown()
    return answers


def check_server_answers(stock: dict, woven: dict, engine_tokens: list[list[int]],
                         prompts: list[str], max_batch: int, max_seq: int) -> None:
    """Assert what both serving tests require of the answers of serve_and_query."""
    for key in ("api", "after_bad", "completions"):
        assert stock[key][0] == 200 and woven[key][0] == 200, (key, stock[key], woven[key])
    assert woven["api"][1]["tokens"] == stock["api"][1]["tokens"]
    assert woven["api"][1]["text"] == stock["api"][1]["text"]
    assert woven["completions"][1] == stock["completions"][1]
    api_tokens = woven["api"][1]["tokens"]
    for prompt, tokens, generated in zip(prompts, api_tokens, engine_tokens, strict=False):
        assert tokens[: len(prompt.encode())] == list(prompt.encode())
        assert tokens[len(prompt.encode()):][: len(generated)] == generated
    for answers in (stock, woven):
        bad = bad_requests(max_batch, max_seq)
        for (method, path, body), (status, reply) in zip(bad, answers["bad"], strict=True):
            assert status == 400, (method, path, body, status, reply)
            assert isinstance(reply, dict) and reply.get("error"), reply
        assert answers["after_bad"] == answers["api"]

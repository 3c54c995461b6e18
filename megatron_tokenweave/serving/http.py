"""Megatron-Core's Flask text generation server (`MegatronServer`: PUT /api, POST /completions)
for a tensor-parallel group: rank 0 answers HTTP, every other rank follows its broadcasts, as
Megatron-LM's tools/run_text_generation_server.py does.

Added on top, because a TP group must never be left half-way through a collective: a request
guard that answers malformed requests (body not JSON, no or empty prompts, wrong types, too many
prompts, prompt + generation longer than the engine's KV cache) with HTTP 400 and a message
*before* any rank is told to generate, and a clean shutdown that releases the followers.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from megatron_tokenweave.log import log_once

GENERATE, STOP = 0, 1  # GENERATE is Megatron's GENERATE_NUM (endpoints/common.py)
DEFAULT_TOKENS = 64  # Megatron's /api default for tokens_to_generate
_COMPLETIONS_NUMBERS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float), "top_p": (int, float),
    "top_k": (int,), "logprobs": (int,), "seed": (int,), "n": (int,), "best_of": (int,),
}


def request_problem(path: str, body: Any, tokenizer: Any, max_batch_size: int,
                    max_sequence_length: int) -> str | None:
    """Why this request must be refused (None when the engine can take it)."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object (Content-Type: application/json)"
    if path.rstrip("/") == "/completions":
        prompts, key, count_key = body.get("prompt"), "prompt", "max_tokens"
        if isinstance(prompts, str):
            prompts = [prompts]
        if count_key not in body:
            return "max_tokens is required"
        count = body[count_key]
        for name, kinds in _COMPLETIONS_NUMBERS.items():  # Megatron casts these unchecked
            value = body.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, kinds):
                return f"{name} must be {'a number' if float in kinds else 'an integer'}"
    else:
        prompts, key, count_key = body.get("prompts"), "prompts", "tokens_to_generate"
        count = body.get(count_key, DEFAULT_TOKENS)
    if prompts is None:
        return f"{key} is required"
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        return f"{key} must be a string or a list of strings"
    if not prompts:
        return f"{key} is empty"
    if len(prompts) > max_batch_size:
        return f"{len(prompts)} prompts, this server takes at most {max_batch_size} at once"
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        return f"{count_key} must be an integer >= 0"
    for i, prompt in enumerate(prompts):
        n = len(tokenizer.tokenize(prompt))
        if n == 0:
            return f"prompt {i} is empty"
        if n + count > max_sequence_length:
            return (f"prompt {i} has {n} tokens; with {count_key}={count} that is "
                    f"{n + count} > the server's maximum sequence length {max_sequence_length}")
    return None


def _broadcast_choice(choice: int) -> int:
    """Rank 0 sends `choice`, the others receive it (Megatron's send_do_generate protocol)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tensor = torch.tensor([choice], dtype=torch.long, device=device)
    dist.broadcast(tensor, 0)
    return int(tensor.item())


class FlaskTextServer:
    """Megatron's MegatronServer over `engine` (a static engine) on every rank of the job.

    Rank 0: `start()` serves in a background thread and `shutdown()` stops HTTP and releases the
    followers; `serve_forever()` does both around a wait for Ctrl-C. Other ranks:
    `serve_forever()` follows rank 0 until it shuts down.
    """

    def __init__(self, engine: Any, max_batch_size: int, max_sequence_length: int,
                 host: str = "127.0.0.1", port: int = 5000) -> None:
        self.engine = engine
        self.rank = dist.get_rank()
        self.host, self.port = host, port
        self._server = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        if self.rank == 0:
            self._server = self._make_server(max_batch_size, max_sequence_length)

    def _make_server(self, max_batch_size: int, max_sequence_length: int):
        from flask import jsonify, request
        from megatron.core.inference.text_generation_server.text_generation_server import (
            MegatronServer,
        )
        from werkzeug.serving import make_server

        app = MegatronServer(self.engine).app
        tokenizer = self.engine.controller.tokenizer
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        @app.before_request
        def guard():
            if device is not None:  # handler threads start on device 0
                torch.cuda.set_device(device)
            if request.method not in ("PUT", "POST") or request.path.rstrip("/") not in (
                "/api", "/completions"
            ):
                return None
            body = request.get_json(silent=True)
            problem = request_problem(request.path, body, tokenizer, max_batch_size,
                                      max_sequence_length)
            if problem is not None:
                return jsonify(error=problem), 400
            return None

        return make_server(self.host, self.port, app, threaded=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Rank 0: serve HTTP in a background thread."""
        if self._server is None:
            raise RuntimeError("only rank 0 serves HTTP; the other ranks call serve_forever()")
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        """Rank 0: serve HTTP until Ctrl-C. Other ranks: follow rank 0 until it stops."""
        if self._server is not None:
            self.start()
            try:
                while self._thread is not None and self._thread.is_alive():
                    self._thread.join(0.5)
            except KeyboardInterrupt:
                pass
            finally:
                self.shutdown()
            return
        from megatron.core.inference.text_generation_server.run_mcore_engine import (
            run_mcore_engine,
        )

        while _broadcast_choice(GENERATE) == GENERATE:
            try:
                run_mcore_engine(self.engine)
            except Exception as err:  # noqa: BLE001 - rank 0 answers the client (an error
                # string or HTTP 500) and keeps serving; stay in step with it
                log_once(f"follower:{type(err).__name__}",
                         f"TokenWeave server rank {self.rank}: request failed: {err!r}")

    def shutdown(self) -> None:
        """Rank 0: stop answering HTTP, then release the followers."""
        from megatron.core.inference.text_generation_server.endpoints.common import LOCK

        if self._server is None or self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        if self._thread is not None:
            self._thread.join()
        with LOCK:  # never between a request's broadcasts
            _broadcast_choice(STOP)

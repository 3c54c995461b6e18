"""Megatron-Core's text generation servers for a tensor-parallel group, kept serving.

* `FlaskTextServer`: Megatron's `MegatronServer` (PUT /api, POST /completions) over the static
  engine; rank 0 answers HTTP, every other rank follows its broadcasts, as Megatron-LM's
  tools/run_text_generation_server.py does.
* `serve_openai`: Megatron's OpenAI-style server (POST /v1/completions) over the dynamic engine.

Added on top, because a TP group must never be left half-way through a collective and one bad
request must not take the server down: the request guard (`serving.guard`) in front of every
generating endpoint; an engine that forgets each request once answered, so that a request that
failed inside the engine (HTTP 500) is not batched into the next ones; and a stop on SIGTERM or
SIGINT (`launch.stop_event`) that lets the request in flight finish, releases the other ranks and
closes the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_tokenweave.communicator import KernelFailure
from megatron_tokenweave.launch import stop_event
from megatron_tokenweave.log import log_once
from megatron_tokenweave.serving.guard import Limits, Refusal, check_request

GENERATE, STOP = 0, 1  # GENERATE is Megatron's GENERATE_NUM (endpoints/common.py)
FLASK_DIALECTS = {("PUT", "/api"): "api", ("POST", "/completions"): "completions"}
OPENAI_PATHS = ("/completions", "/v1/completions")  # both routes of Megatron's OpenAI endpoint
_STOP_POLL_S = 0.2


def _unwrapped_model(engine: Any) -> torch.nn.Module:
    from megatron.core.utils import unwrap_model

    return unwrap_model(engine.controller.inference_wrapped_model.model)


def _workspace_tokens(model: torch.nn.Module) -> int | None:
    """The smallest TokenWeave workspace capacity of the model's layers (None: no such layer)."""
    from megatron_tokenweave.config import TokenWeaveConfig

    return min((m.tokenweave_config.max_tokens for m in model.modules()
                if isinstance(getattr(m, "tokenweave_config", None), TokenWeaveConfig)),
               default=None)


def static_limits(engine: Any) -> Limits:
    """What a request may ask of Megatron's static engine: its KV cache (batch x sequence), the
    model's positions and vocabulary, and the TokenWeave workspace of its first forward."""
    context = engine.controller.inference_wrapped_model.inference_context
    model = _unwrapped_model(engine)
    max_seq = min(context.max_sequence_length,
                  getattr(model, "max_sequence_length", context.max_sequence_length))
    return Limits(max_prompts=min(context.max_batch_size, engine.scheduler.max_batch_size),
                  max_sequence_length=max_seq, vocab_size=engine.controller.vocab_size,
                  max_prefill_tokens=_workspace_tokens(model),
                  pads_batch=getattr(model.config, "cuda_graph_impl", "none") == "local")


class EngineError(RuntimeError):
    """A request failed inside the engine; the engine has forgotten it. `data` is the JSON body
    of the HTTP 500 (flask-restful answers with an exception's `data`)."""

    def __init__(self, error: BaseException) -> None:
        message = f"the engine failed on this request: {type(error).__name__}: {error}"
        super().__init__(message)
        self.data = {"error": message, "field": None}


class RequestScopedEngine:
    """Megatron's static engine as a server drives it: each `generate` leaves the scheduler as it
    found it, whether it returned or raised.

    Megatron's legacy static engine keeps a request that raised in its active pool and batches it,
    with its sampling parameters, into every later `generate` (one bad request fails all later
    ones), and keeps every finished request forever. The replies are built from the returned
    requests, which stay valid."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.fatal: KernelFailure | None = None  # a kernel failure: the server must stop

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        scheduler = self._engine.scheduler
        before = set(scheduler.requests)
        try:
            return self._engine.generate(*args, **kwargs)
        except KernelFailure as err:  # every rank raises it (watch_failures): not one request's
            self.fatal = err
            raise
        except Exception as err:
            raise EngineError(err) from err
        finally:
            for request_id in set(scheduler.requests) - before:
                for pool in (scheduler.requests, scheduler.active_request_pool,
                             scheduler.waiting_request_pool, scheduler.completed_request_pool,
                             scheduler.streams):
                    pool.pop(request_id, None)


def _broadcast_choice(choice: int) -> int:
    """Rank 0 sends `choice`, the others receive it (Megatron's send_do_generate protocol)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tensor = torch.tensor([choice], dtype=torch.long, device=device)
    dist.broadcast(tensor, 0)
    return int(tensor.item())


class FlaskTextServer:
    """Megatron's MegatronServer over `engine` (a static engine) on every rank of the job.

    Rank 0: `start()` serves in a background thread and `shutdown()` stops HTTP, waits for the
    requests in flight, releases the followers and closes the port; `serve_forever()` does both
    around a wait for `launch.stop_event()` (SIGTERM, SIGINT). Other ranks: `serve_forever()`
    follows rank 0 until it shuts down. `limits` default to the engine's (`static_limits`).
    `port=0` lets the system choose a free port (rank 0's `port` and `url` then name it), with
    no window in which another socket can take a port picked beforehand.
    """

    def __init__(self, engine: Any, host: str = "127.0.0.1", port: int = 5000,
                 limits: Limits | None = None) -> None:
        self.engine = RequestScopedEngine(engine)
        self.limits = limits or static_limits(engine)
        self.rank = dist.get_rank()
        self.host, self.port = host, port
        self._server = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._in_flight = 0
        self._idle = threading.Condition()
        if self.rank == 0:
            self._server = self._make_server()

    def _make_server(self):
        from flask import jsonify, request
        from megatron.core.inference.text_generation_server.text_generation_server import (
            MegatronServer,
        )
        from werkzeug.serving import make_server, select_address_family

        app = MegatronServer(self.engine).app
        tokenizer = self.engine.controller.tokenizer
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        @app.before_request
        def guard():
            if device is not None:  # handler threads start on device 0
                torch.cuda.set_device(device)
            dialect = FLASK_DIALECTS.get((request.method, request.path.rstrip("/")))
            if dialect is None:
                return None
            try:
                check_request(dialect, request.get_json(silent=True), tokenizer, self.limits)
            except Refusal as refusal:
                return jsonify(refusal.body()), refusal.status
            with self._idle:
                if self._stopped:
                    return jsonify(error="the server is stopping", field=None), 503
                self._in_flight += 1
            request.environ["tokenweave.counted"] = True
            return None

        @app.teardown_request
        def done(_error):
            if request.environ.pop("tokenweave.counted", False):
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

        # Bound here: werkzeug answers a port in use with sys.exit(1), hiding the reason.
        listener = socket.create_server((self.host, self.port),
                                        family=select_address_family(self.host, self.port))
        self.port = listener.getsockname()[1]  # port 0: the one the system chose (`url`)
        try:
            return make_server(self.host, self.port, app, threaded=True, fd=listener.fileno())
        finally:
            listener.close()  # the server holds its own duplicate

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
        """Rank 0: serve HTTP until `launch.stop_event()` is set (SIGTERM, SIGINT) or Ctrl-C.
        Other ranks: follow rank 0 until it stops."""
        stop = stop_event()  # on the followers too: a stop request must not kill them
        if self._server is not None:
            self.start()
            try:
                while (self._thread is not None and self._thread.is_alive() and not stop.is_set()
                       and self.engine.fatal is None):
                    stop.wait(_STOP_POLL_S)
            except KeyboardInterrupt:
                pass
            finally:
                if self.engine.fatal is None:
                    self.shutdown()
            if self.engine.fatal is not None:  # the followers raised it too: no STOP to send
                self._stopped = True
                self._server.shutdown()
                self._server.server_close()
                raise self.engine.fatal
            return
        from megatron.core.inference.text_generation_server.run_mcore_engine import (
            run_mcore_engine,
        )

        while _broadcast_choice(GENERATE) == GENERATE:
            try:
                run_mcore_engine(self.engine)
            except EngineError as err:  # rank 0 answers the client with HTTP 500; stay in step
                log_once(f"follower:{err}", f"TokenWeave server rank {self.rank}: {err}")

    def shutdown(self) -> None:
        """Rank 0: stop taking requests, let those in flight finish, release the followers and
        close the port."""
        from megatron.core.inference.text_generation_server.endpoints.common import LOCK

        if self._server is None or self._stopped:
            return
        with self._idle:
            self._stopped = True
        self._server.shutdown()
        if self._thread is not None:
            self._thread.join()
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)
        with LOCK:  # never between a request's broadcasts
            _broadcast_choice(STOP)
        self._server.server_close()


def dynamic_limits(llm: Any) -> Limits:
    """What a request may ask of Megatron's dynamic engine behind `llm` (MegatronAsyncLLM): its
    maximum sequence length, capped by the KV blocks one request can hold, and the vocabulary.
    Its chunked prefill never exceeds the chunk size, which the workspace is sized for."""
    context = llm.engine.context
    kv_tokens = (context.kv_block_allocator.total_count - 1) * context.block_size_tokens
    return Limits(max_prompts=context.max_requests,
                  max_sequence_length=min(context.max_sequence_length, kv_tokens),
                  vocab_size=llm.engine.controller.vocab_size)


def openai_guard(tokenizer: Any, limits: Limits):
    """A Quart blueprint whose before-app-request hook refuses, with HTTP 400 and JSON, every
    /v1/completions request the dynamic engine must not see."""
    from quart import Blueprint, jsonify, request

    blueprint = Blueprint("tokenweave_guard", __name__)

    @blueprint.before_app_request
    async def guard():
        if request.method != "POST" or request.path.rstrip("/") not in OPENAI_PATHS:
            return None
        body = await request.get_json(force=True, silent=True)
        try:
            check_request("openai", body, tokenizer, limits)
        except Refusal as refusal:
            return jsonify(refusal.body()), refusal.status
        return None

    return blueprint


@contextlib.contextmanager
def _guarded_openai_frontends(tokenizer: Any, limits: Limits) -> Iterator[None]:
    """Megatron's OpenAI frontends register every blueprint of its endpoints package when they
    start (forked children of rank 0); the guard is one of them while this scope lasts."""
    from megatron.core.inference.text_generation_server.dynamic_text_gen_server import endpoints

    blueprint = openai_guard(tokenizer, limits)
    endpoints.__all__.insert(0, blueprint)
    try:
        yield
    finally:
        endpoints.__all__.remove(blueprint)


async def serve_openai(llm: Any, serve_config: Any) -> None:
    """Every rank: Megatron's OpenAI-style server (`llm` a MegatronAsyncLLM built with
    `dynamic_llm(serving=True)`; rank 0 hosts HTTP) with the request guard, until
    `launch.stop_event()` is set (then shut it down) or the engine's loop ends: normally when
    rank 0 shut it down; if it failed (Megatron then exits the loop's thread), raise, so that the
    launcher takes the job down."""
    stop = stop_event()
    with _guarded_openai_frontends(llm.engine.controller.tokenizer, dynamic_limits(llm)):
        await llm.serve(serve_config, blocking=False)
    engine_loop = llm.engine.engine_loop_task  # on the engine's own loop and thread
    while not stop.is_set() and not engine_loop.done():
        await asyncio.sleep(_STOP_POLL_S)
    if engine_loop.done() and (engine_loop.cancelled() or engine_loop.exception() is not None):
        raise RuntimeError("Megatron's dynamic engine loop failed; see its traceback above")
    await llm.shutdown()

"""Megatron's inference stack with the TokenWeave spec at TP=2 (bf16, the CUDA kernel): greedy
generations equal the stock spec's (TE spec when TE imports, else local) through the static
engine, the static engine with Megatron's per-layer CUDA graphs (cuda_graph_impl="local"), the
Flask server's HTTP API and, where flash-attn is installed, the dynamic engine (MegatronLLM),
its inference CUDA graphs and a soak of Megatron's OpenAI-style server.

On 2 GPUs the ranks talk over NCCL. With one GPU both ranks share it over gloo (the woven
layer's buffer over CUDA IPC, as in the layer's one-GPU tests): functional, not timed; the CUDA
graph tests then skip, since gloo moves CUDA tensors through the host, which a capture cannot
hold. Skipped without a GPU.

Random weights give near-tied logits, where bf16 rounding alone flips greedy choices; the model
here first memorizes a short text (a few seconds of training with the stock spec), so its greedy
continuations are confident, as a trained model's are.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from _serving import (  # noqa: E402
    SOAK_REQUESTS,
    SOAK_S,
    ServerProcess,
    Soak,
    arm_engine_fault,
    check_bad_answer,
    check_server_answers,
    http,
    serve_and_query,
)

from megatron_tokenweave.launch import free_port, spawn  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
captures_collectives = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="captures collectives in CUDA graphs: needs NCCL, so 2 GPUs (gloo goes through the "
           "host)")

TEXT = (
    "TokenWeave splits the tokens of a batch in two halves. While the first half computes, the "
    "all-reduce of the second half runs beside it on a few SMs, fused with the residual add and "
    "the RMSNorm that follows. Megatron serves the model exactly as before, only faster. "
)
PROMPTS = [TEXT[:40], TEXT[57:90], TEXT[120:170], TEXT[200:226]]
NEW_TOKENS = 24
MAX_BATCH, MAX_SEQ = 4, 256
LAYERS = 2


def _memorize_(model: torch.nn.Module, steps: int = 300, seq: int = 64, batch: int = 32) -> float:
    """Train `model` (fp32, TP ranks in step) to continue TEXT; returns the last loss."""
    data = torch.tensor(list((TEXT * 4).encode()), device="cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)  # same windows on every rank
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        starts = torch.randint(0, len(TEXT), (batch,), generator=gen)
        windows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        tokens, labels = windows[:, :-1], windows[:, 1:]
        pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(batch, -1)
        loss = model(tokens, pos, attention_mask=None, labels=labels).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss)


HYBRID = "*-" * LAYERS  # the HybridModel of the same decoder: one stage a layer


def _models(world: int, model_class: str = "gpt", **config_overrides):
    """(stock, tokenweave) bf16 models with the same memorized weights: GPTModels, or
    HybridModels of HYBRID (the GPT trainee's weights mapped layer by layer); the stock side is
    Megatron's TE spec / hybrid_stack_spec when TE imports, else the local forms."""
    from megatron_tokenweave.config import TokenWeaveConfig
    from megatron_tokenweave.hybrid import (
        get_hybrid_stack_tokenweave_spec,
        gpt_to_hybrid_state_dict,
    )
    from megatron_tokenweave.models import (
        Shape,
        build_gpt,
        build_hybrid,
        clear_attention_backend_env,
        llama_config,
        pattern_layers,
        stock_hybrid_stack_spec,
        stock_layer_spec,
    )
    from megatron_tokenweave.spec import get_gpt_layer_tokenweave_spec, te_available

    shape = Shape(512, 1536, 8, 4, vocab=256)
    te = te_available()
    stock_spec = stock_layer_spec(shape, te)
    torch.manual_seed(0)
    trainee = build_gpt(llama_config(shape, LAYERS, world), stock_spec, shape.vocab, MAX_SEQ)
    loss = _memorize_(trainee.cuda())
    state = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
             for k, v in trainee.state_dict().items()}
    del trainee
    clear_attention_backend_env()  # the trainee's backend may differ from config_overrides'
    tw_config = TokenWeaveConfig(split_threshold=32, tuning_table="none")
    common = dict(bf16=True, params_dtype=torch.bfloat16, **config_overrides)
    if model_class == "hybrid":
        cfg = llama_config(shape, pattern_layers(HYBRID), world, is_hybrid_model=True, **common)
        stock = build_hybrid(cfg, stock_hybrid_stack_spec(te), shape.vocab, MAX_SEQ, HYBRID)
        woven = build_hybrid(cfg, get_hybrid_stack_tokenweave_spec(te, tw_config), shape.vocab,
                             MAX_SEQ, HYBRID)
        state = gpt_to_hybrid_state_dict(state)
    else:
        cfg = llama_config(shape, LAYERS, world, **common)
        stock = build_gpt(cfg, stock_spec, shape.vocab, MAX_SEQ)
        woven = build_gpt(cfg, get_gpt_layer_tokenweave_spec(te, tw_config), shape.vocab,
                          MAX_SEQ)
    stock, woven = stock.cuda(), woven.cuda()
    stock.load_state_dict(state, strict=True)
    woven.load_state_dict(state, strict=True)
    return stock, woven, loss


def _static(rank: int, world: int, ports: list[int], cuda_graphs: bool,
            model_class: str = "gpt") -> dict:
    from megatron_tokenweave.launch import initialize_model_parallel
    from megatron_tokenweave.serving.engines import generated_tokens, greedy, static_engine
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    initialize_model_parallel(world)
    overrides = dict(cuda_graph_impl="local", flash_decode=True) if cuda_graphs else {}
    stock, woven, loss = _models(world, model_class, **overrides)
    out: dict = {"loss": loss}
    for i, (name, model) in enumerate((("stock", stock), ("tokenweave", woven))):
        if ports:  # the HTTP session sends a request that fails inside the engine
            arm_engine_fault(model)
        engine = static_engine(model, ByteTokenizer(), MAX_BATCH, MAX_SEQ)
        requests = engine.generate(prompts=PROMPTS, sampling_params=greedy(NEW_TOKENS))
        out[name] = dict(tokens=generated_tokens(requests))
        if ports:
            out[name]["http"] = serve_and_query(engine, ports[i], PROMPTS, NEW_TOKENS,
                                                MAX_BATCH, MAX_SEQ)
    return out


def _check_generations(result: dict) -> None:
    stock, woven = result["stock"]["tokens"], result["tokenweave"]["tokens"]
    # The stock model learned the text: its greedy continuation of each prompt is the text.
    for prompt, tokens in zip(PROMPTS, stock, strict=True):
        start = TEXT.index(prompt) + len(prompt)
        assert bytes(tokens).decode(errors="replace") == TEXT[start : start + len(tokens)], (
            f"the model did not memorize the text (loss {result['loss']:.3f})")
    assert woven == stock


@pytest.mark.parametrize("model_class", ["gpt", "hybrid"])
def test_static_engine_and_flask_server_match_stock(model_class):
    per_rank = spawn(_static, 2, [0, 0], False, model_class)
    for result in per_rank:
        _check_generations(result)
    check_server_answers(per_rank[0]["stock"]["http"], per_rank[0]["tokenweave"]["http"],
                         per_rank[0]["tokenweave"]["tokens"], PROMPTS, MAX_BATCH, MAX_SEQ)


@captures_collectives
def test_static_engine_with_megatron_cuda_graphs_matches_stock():
    """cuda_graph_impl="local": Megatron captures each layer's forward as its own graph; the
    woven layer then joins its side stream at the layer boundary. Megatron's static engine
    allows that only with flash decode (flash-attn 2's flash_attn_with_kvcache)."""
    from megatron.core.transformer import attention

    if getattr(attention, "flash_attn_with_kvcache", None) is None:
        pytest.skip("Megatron's static-engine CUDA graphs need flash decode (flash-attn 2)")
    for result in spawn(_static, 2, [], True):
        _check_generations(result)


def _dynamic(rank: int, world: int, cuda_graph_scope: str | None = None,
             model_class: str = "gpt") -> dict:
    from megatron_tokenweave.launch import initialize_model_parallel
    from megatron_tokenweave.serving.engines import (
        dynamic_config_overrides,
        dynamic_llm,
        generated_tokens,
        greedy,
    )
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    initialize_model_parallel(world)
    stock, woven, loss = _models(world, model_class, **dynamic_config_overrides(cuda_graph_scope))
    out: dict = {"loss": loss}
    for name, model in (("stock", stock), ("tokenweave", woven)):
        llm = dynamic_llm(model, ByteTokenizer(), MAX_SEQ, max_requests=MAX_BATCH,
                          chunk_tokens=64, buffer_size_gb=1.0,
                          cuda_graphs=8 if cuda_graph_scope else None)
        try:
            requests = llm.generate([list(p.encode()) for p in PROMPTS], greedy(NEW_TOKENS))
            graphs = (len(llm.engine.context.cuda_graph_batch_dimensions_list)
                      if llm.engine.capture_stats is not None else 0)
        finally:
            llm.shutdown()
        out[name] = dict(tokens=generated_tokens(requests), graphs=graphs)
    return out


@pytest.mark.parametrize("model_class", ["gpt", "hybrid"])
def test_dynamic_engine_matches_stock(model_class):
    """MegatronLLM (dynamic engine, chunked prefill of 64 tokens, so prompts span chunks)."""
    from megatron_tokenweave.serving.engines import dynamic_engine_problem

    if (problem := dynamic_engine_problem()) is not None:
        pytest.skip(problem)
    for result in spawn(_dynamic, 2, None, model_class):
        _check_generations(result)


@captures_collectives
@pytest.mark.parametrize("scope", ["layer", "block"])
def test_dynamic_engine_with_cuda_graphs_matches_stock(scope):
    """Megatron's inference CUDA graphs (cuda_graph_impl="local") at layer scope (the woven
    layer joins its side stream at each layer boundary) and block scope: the same greedy tokens
    as the stock model under the same graphs."""
    from megatron_tokenweave.serving.engines import dynamic_engine_problem

    if (problem := dynamic_engine_problem()) is not None:
        pytest.skip(problem)
    for result in spawn(_dynamic, 2, scope):
        _check_generations(result)
        assert result["stock"]["graphs"] > 0 and result["tokenweave"]["graphs"] > 0, (
            "Megatron captured no inference CUDA graphs")


def _openai_request(body: dict) -> tuple[str, str, bytes]:
    return "POST", "/v1/completions", json.dumps(body).encode()


# Greedy requests of every prompt form the endpoint takes; the stock server's replies are the
# reference for each.
OPENAI_VALID = [
    _openai_request({"prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0}),
    _openai_request({"prompt": PROMPTS[1:3], "max_tokens": 16, "temperature": 0}),
    _openai_request({"prompt": list(PROMPTS[3].encode()), "max_tokens": 12, "temperature": 0}),
    _openai_request({"prompt": [list(PROMPTS[0].encode())], "max_tokens": 8, "temperature": 0,
                     "logprobs": 2}),
    _openai_request({"prompt": PROMPTS[2], "max_tokens": 20, "temperature": 0, "stop": "."}),
    _openai_request({"prompt": PROMPTS[3], "max_tokens": 10, "top_k": 1, "top_p": 0}),
]
# What the guard refuses (the field its JSON error names): several would stop Megatron's engine
# loop for good (top_k with the default top_p, logprobs with echo), others be silently altered.
OPENAI_BAD = [
    (_openai_request({"prompt": "Hello", "max_tokens": 4, "top_k": 1}), "top_k"),
    (_openai_request({"prompt": "Hello", "top_k": 256, "top_p": 0}), "top_k"),
    (_openai_request({"prompt": "Hello", "temperature": -1}), "temperature"),
    (_openai_request({"prompt": "x", "logprobs": 2, "echo": True}), "logprobs"),
    (_openai_request({"prompt": ""}), "prompt"),
    (_openai_request({"prompt": []}), "prompt"),
    (_openai_request({"prompt": 5}), "prompt"),
    (_openai_request({"prompt": [1, 300]}), "prompt"),
    (_openai_request({"prompt": "x" * (MAX_SEQ + 1), "max_tokens": 8}), "prompt"),
    (_openai_request({"prompt": "x", "max_tokens": MAX_SEQ}), "prompt"),
    (_openai_request({"prompt": ["x"] * (MAX_BATCH + 1)}), "prompt"),
    (_openai_request({"prompt": "x", "max_tokens": 0}), "max_tokens"),
    (_openai_request({"prompt": "x", "n": 2}), "n"),
    (_openai_request({"prompt": "x", "stream": True}), "stream"),
    (_openai_request({"prompt": "x", "seed": 1}), "seed"),
    (("POST", "/v1/completions", b"{not json"), None),
]


def _wait_healthy(url: str, timeout: float = 120.0) -> None:
    """Until Megatron's HTTP frontend (its own processes) answers /health."""
    deadline = time.time() + timeout
    while True:
        try:
            http(url + "/health", "GET", None)
            return
        except (urllib.error.URLError, ConnectionError):
            if time.time() > deadline:
                raise
            time.sleep(1)


def _reference(url: str) -> list:
    _wait_healthy(url)
    return [http(url + path, method, body) for method, path, body in OPENAI_VALID]


def _soak(url: str) -> dict:
    _wait_healthy(url)
    start = time.monotonic()
    replies = Soak(url, OPENAI_VALID, OPENAI_BAD, SOAK_S, SOAK_REQUESTS - len(OPENAI_VALID)).run()
    final = [http(url + path, method, body) for method, path, body in OPENAI_VALID]
    return dict(replies=replies, final=final, served_s=time.monotonic() - start)


def _openai_soak(rank: int, world: int, ports: list[int], model_class: str = "gpt",
                 soak: bool = True) -> dict:
    """Megatron's OpenAI-style server (serve_openai: the guard, a stop on SIGTERM) over the
    dynamic engine: the stock model's replies to OPENAI_VALID, then a soak of the TokenWeave
    model's server (without `soak`: its replies to OPENAI_VALID); rank 0 ends each with
    SIGTERM to itself, as the launcher relays one."""
    import asyncio

    from megatron.core.inference.apis import ServeConfig

    from megatron_tokenweave.launch import initialize_model_parallel, stop_event
    from megatron_tokenweave.serving.engines import dynamic_config_overrides, dynamic_llm
    from megatron_tokenweave.serving.http import serve_openai
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    initialize_model_parallel(world)
    stock, woven, loss = _models(world, model_class, **dynamic_config_overrides())

    async def session(model, port: int, drive):
        llm = dynamic_llm(model, ByteTokenizer(), MAX_SEQ, max_requests=MAX_BATCH,
                          chunk_tokens=64, buffer_size_gb=1.0, serving=True)
        config = ServeConfig(host="127.0.0.1", port=port, frontend_replicas=1)
        server = asyncio.ensure_future(serve_openai(llm, config))
        answers = None
        if rank == 0:
            answers = await asyncio.to_thread(drive, f"http://127.0.0.1:{port}")
            os.kill(os.getpid(), signal.SIGTERM)
        await server
        return answers

    out: dict = {"loss": loss, "stock": asyncio.run(session(stock, ports[0], _reference))}
    stop_event().clear()
    out["tokenweave"] = asyncio.run(session(woven, ports[1], _soak if soak else _reference))
    return out


def _completions(answer: tuple[int, dict]) -> list[tuple[str, list[int]]]:
    """Text and token ids of each choice (the replies also carry ids, timestamps, log-probs)."""
    assert answer[0] == 200, answer
    return [(c["text"], c.get("generation_token_ids")) for c in answer[1]["choices"]]


def test_openai_server_soak_matches_stock():
    """A soak of POST /v1/completions on Megatron's dynamic OpenAI-style server with the
    guard: concurrent clients, valid and bad requests paced over SOAK_S seconds. Every valid
    reply equals the stock model's server's, every bad request gets 400 with a JSON error naming
    the field, the server still answers at the end, and SIGTERM ends both servers cleanly (the
    job returns)."""
    from megatron_tokenweave.serving.engines import dynamic_engine_problem

    if (problem := dynamic_engine_problem()) is not None:
        pytest.skip(problem)
    for module in ("quart", "hypercorn", "zmq", "msgpack"):
        pytest.importorskip(module)
    result = spawn(_openai_soak, 2, [free_port(), free_port()])[0]
    expected = [_completions(answer) for answer in result["stock"]]
    text, _ = expected[0][0]  # the stock model continues the memorized text
    start = TEXT.index(PROMPTS[0]) + len(PROMPTS[0])
    assert text and text == TEXT[start : start + len(text)], (text, result["loss"])
    soak = result["tokenweave"]
    kinds = {kind: [r for r in soak["replies"] if r.kind == kind] for kind in ("valid", "bad")}
    assert len(soak["replies"]) == SOAK_REQUESTS - len(OPENAI_VALID) and all(kinds.values())
    for reply in kinds["valid"]:
        assert _completions((reply.status, reply.reply)) == expected[reply.index], reply
    for reply in kinds["bad"]:
        check_bad_answer(OPENAI_BAD[reply.index], (reply.status, reply.reply))
    assert soak["served_s"] >= SOAK_S
    assert [_completions(answer) for answer in soak["final"]] == expected


def test_openai_server_with_a_hybrid_model_matches_stock():
    """The same server over a woven HybridModel: its replies to every valid request equal the
    stock hybrid stack's server's (and the stock one continues the memorized text)."""
    from megatron_tokenweave.serving.engines import dynamic_engine_problem

    if (problem := dynamic_engine_problem()) is not None:
        pytest.skip(problem)
    for module in ("quart", "hypercorn", "zmq", "msgpack"):
        pytest.importorskip(module)
    result = spawn(_openai_soak, 2, [free_port(), free_port()], "hybrid", False)[0]
    expected = [_completions(answer) for answer in result["stock"]]
    text, _ = expected[0][0]
    start = TEXT.index(PROMPTS[0]) + len(PROMPTS[0])
    assert text and text == TEXT[start : start + len(text)], (text, result["loss"])
    assert [_completions(answer) for answer in result["tokenweave"]] == expected


def test_openai_example_server_stops_on_sigterm(tmp_path):
    """examples/serve.py --server openai: answers, then SIGTERM to its launcher leaves no rank
    and a free port within 5 s, exit status 0 and one line."""
    from megatron_tokenweave.serving.engines import dynamic_engine_problem

    if (problem := dynamic_engine_problem()) is not None:
        pytest.skip(problem)
    for module in ("quart", "hypercorn", "zmq", "msgpack"):
        pytest.importorskip(module)
    server = ServerProcess(free_port(), str(tmp_path), "--server", "openai", "--max-batch", "4",
                           "--max-seq", "256", "--kv-gb", "1")
    try:
        server.wait_ready()
        _wait_healthy(server.url)
        status, reply = http(server.url + "/v1/completions", "POST",
                             json.dumps({"prompt": "Hello", "max_tokens": 4}).encode())
        assert status == 200 and reply["choices"], reply
        elapsed, out, err = server.stop(signal.SIGTERM, 5.0)
    finally:
        server.kill()
    assert elapsed < 5.0 and server.proc.returncode == 0, (elapsed, err[-2000:])
    assert out.splitlines() == ["serve.py: stopped by SIGTERM; all 2 ranks exited"], out
    assert "Traceback" not in err, err[-2000:]

"""Megatron's inference stack with the TokenWeave spec on 2 gloo ranks (TP=2, fp32, reference
path): the static engine's greedy generations and the Flask text generation server's answers
over real HTTP equal those of the stock local spec with the same weights (GPTModel), and of the
stock hybrid stack (HybridModel); the server answers
malformed requests with HTTP 400, a request that fails inside the engine with HTTP 500, and
keeps serving. The request guard's verdicts are checked one by one in-process.

One spawned job runs everything; the tests assert on what the ranks returned.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _dist import (
    build_hybrid_model,
    build_model,
    randomize_norms_,
    record_fused_calls,
    run_ranks,
    setup_tp,
)
from _serving import arm_engine_fault, check_server_answers, serve_and_query

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.models import SHAPES

SHAPE = SHAPES["tiny"]  # vocab 256: every generated id is a byte
LAYERS = 3
THRESHOLD = 16
MAX_BATCH, MAX_SEQ = 4, 96
NEW_TOKENS = 12
PROMPTS = ["The quick brown fox", "TokenWeave: overlap!", "tensor parallel", "a"]


def _megatron_assertion_then_greedy(engine) -> tuple[str, list[list[int]]]:
    """Megatron's own assertion inside the engine (top_k with top_p, which the guard refuses
    before the engine): the error, then the greedy tokens of PROMPTS through the same engine."""
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_tokenweave.serving.engines import generated_tokens, greedy
    from megatron_tokenweave.serving.http import EngineError, RequestScopedEngine

    scoped = RequestScopedEngine(engine)
    try:
        scoped.generate(prompts=PROMPTS[:2], sampling_params=SamplingParams(
            top_k=1, top_p=1.0, num_tokens_to_generate=NEW_TOKENS))
        error = ""
    except EngineError as err:
        error = str(err)
    again = scoped.generate(prompts=PROMPTS, sampling_params=greedy(NEW_TOKENS))
    return error, generated_tokens(again)


HYBRID = "*-*-*-"  # the same decoder as LAYERS GPT layers, as a HybridModel of one stage a layer


def _serving_worker(rank: int, world: int) -> dict:
    from megatron_tokenweave.cpu_compat import cpu_inference_scope
    from megatron_tokenweave.serving.engines import generated_tokens, greedy, static_engine
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    setup_tp(world)
    tw_config = TokenWeaveConfig(split_threshold=THRESHOLD, split_align=1, tuning_table="none")
    stock = build_model("stock", SHAPE, LAYERS, world, max_seq=MAX_SEQ)
    randomize_norms_(stock, seed=11)
    woven = build_model("tokenweave", SHAPE, LAYERS, world, tw_config, max_seq=MAX_SEQ)
    woven.load_state_dict(stock.state_dict(), strict=True)
    hybrid_stock = build_hybrid_model("stock", SHAPE, HYBRID, world, max_seq=MAX_SEQ)
    randomize_norms_(hybrid_stock, seed=12)
    hybrid_woven = build_hybrid_model("tokenweave", SHAPE, HYBRID, world, tw_config,
                                      max_seq=MAX_SEQ)
    hybrid_woven.load_state_dict(hybrid_stock.state_dict(), strict=True)
    tokenizer = ByteTokenizer(SHAPE.vocab)
    out: dict = {}
    with cpu_inference_scope():
        for name, model in (("stock", stock), ("tokenweave", woven),
                            ("hybrid_stock", hybrid_stock), ("hybrid_tokenweave", hybrid_woven)):
            arm_engine_fault(model)
            engine = static_engine(model, tokenizer, MAX_BATCH, MAX_SEQ)
            with record_fused_calls() as calls:
                requests = engine.generate(prompts=PROMPTS, sampling_params=greedy(NEW_TOKENS))
            out[name] = dict(tokens=generated_tokens(requests),
                             text=[r.generated_text for r in requests], calls=list(calls))
            out[name]["http"] = serve_and_query(engine, 0, PROMPTS, NEW_TOKENS, MAX_BATCH,
                                                MAX_SEQ)  # port 0: the system picks one
            if not name.startswith("hybrid"):
                out[name]["after_assertion"] = _megatron_assertion_then_greedy(engine)
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(_serving_worker)


def test_static_engine_greedy_tokens_match_stock(per_rank):
    """Greedy generation through Megatron's static engine: the same tokens and text with the
    TokenWeave spec as with the stock spec, on every rank, for prompts of mixed lengths. A prompt
    may end at once (a random model's first greedy token may be the end-of-document id; one CI
    run had a prompt with no generated token), so the comparison's non-triviality is asserted
    over all prompts together: at least a full generation's worth of tokens."""
    for result in per_rank:
        stock, woven = result["stock"], result["tokenweave"]
        assert len(stock["tokens"]) == len(PROMPTS)
        assert all(len(t) <= NEW_TOKENS for t in stock["tokens"])
        assert sum(len(t) for t in stock["tokens"]) >= NEW_TOKENS, stock["tokens"]
        assert woven["tokens"] == stock["tokens"]
        assert woven["text"] == stock["text"]
    assert per_rank[0]["stock"]["tokens"] == per_rank[1]["stock"]["tokens"]


def test_static_engine_runs_the_woven_paths(per_rank):
    """The prefill (4 prompts x the shortest length >= THRESHOLD rows) ran split (two halves),
    the decode steps (4 rows) unsplit; the stock model never called the fused op."""
    for result in per_rank:
        calls = result["tokenweave"]["calls"]
        rows = len(PROMPTS) * min(len(p.encode()) for p in PROMPTS)
        prefill = [(1, rows // 2), (1, rows - rows // 2)] * 2 * LAYERS if rows >= THRESHOLD \
            else [(1, rows)] * 2 * LAYERS
        assert calls[: len(prefill)] == prefill
        assert len(calls) > len(prefill) and set(calls[len(prefill):]) == {(1, len(PROMPTS))}
        assert result["stock"]["calls"] == []


def test_flask_server_matches_stock_and_refuses_malformed_requests(per_rank):
    """PUT /api and POST /completions (greedy) over HTTP: status 200 and the same tokens and text
    from the TokenWeave server as from the stock one, /api agreeing with the engine; every
    malformed request gets HTTP 400 with a JSON error naming the field, a request that fails
    inside the engine gets HTTP 500 with a JSON error, and the next good request is answered
    exactly as by the fresh server (the failed request left the engine; no rank was left in a
    collective)."""
    check_server_answers(per_rank[0]["stock"]["http"], per_rank[0]["tokenweave"]["http"],
                         per_rank[0]["tokenweave"]["tokens"], PROMPTS, MAX_BATCH, MAX_SEQ)


def test_hybrid_model_serves_the_stock_hybrid_stacks_tokens(per_rank):
    """A woven HybridModel (`*-*-*-`) through Megatron's static engine and its Flask server:
    the stock hybrid stack's greedy tokens and text, and its HTTP answers (malformed requests
    400, an engine failure 500, then served again); one fused op per layer per half, the decode
    steps unsplit."""
    for result in per_rank:
        stock, woven = result["hybrid_stock"], result["hybrid_tokenweave"]
        assert sum(len(t) for t in stock["tokens"]) >= NEW_TOKENS, stock["tokens"]
        assert woven["tokens"] == stock["tokens"] and woven["text"] == stock["text"]
        rows = len(PROMPTS) * min(len(p.encode()) for p in PROMPTS)
        prefill = [(1, rows // 2), (1, rows - rows // 2)] * len(HYBRID) if rows >= THRESHOLD \
            else [(1, rows)] * len(HYBRID)
        assert woven["calls"][:len(prefill)] == prefill
        assert set(woven["calls"][len(prefill):]) == {(1, len(PROMPTS))}
        assert stock["calls"] == []
    check_server_answers(per_rank[0]["hybrid_stock"]["http"],
                         per_rank[0]["hybrid_tokenweave"]["http"],
                         per_rank[0]["hybrid_tokenweave"]["tokens"], PROMPTS, MAX_BATCH, MAX_SEQ)


def test_engine_keeps_serving_after_megatron_asserts(per_rank):
    """Megatron's own assertion (top_k with top_p) inside the static engine fails that generate
    only: the next greedy generate through the same engine returns the fresh engine's tokens
    (Megatron's engine alone would batch the failed request into it and fail again)."""
    for result in per_rank:
        for name in ("stock", "tokenweave"):
            error, tokens = result[name]["after_assertion"]
            assert "Cannot have top-p and top-k both greater than zero" in error, error
            assert tokens == result[name]["tokens"]


def test_tokenizer_round_trip():
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    tok = ByteTokenizer(1000)
    text = "héllo, wörld"
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.detokenize([104, 300, 105]) == "h<300>i"
    with pytest.raises(ValueError, match="at least 256"):
        ByteTokenizer(100)
    assert torch.tensor(tok.offsets([104, 300, 105], "h<300>i")).tolist() == [0, 1, 6]


GUARD_LIMITS = dict(max_prompts=4, max_sequence_length=99, vocab_size=256)


@pytest.mark.parametrize(
    ("dialect", "body", "field", "problem"),
    [
        ("api", None, None, "JSON object"),
        ("api", [1, 2], None, "JSON object"),
        ("api", {}, "prompts", "prompts is required"),
        ("api", {"prompts": [1]}, "prompts", "a list of strings, got list"),
        ("api", {"prompts": "x"}, "prompts", "must be a list of strings, got str"),
        ("api", {"prompts": ["ok"], "tokens_to_generate": True}, "tokens_to_generate", ">= 0"),
        ("api", {"prompts": ["ok"], "tokens_to_generate": 2.5}, "tokens_to_generate", ">= 0"),
        ("api", {"prompts": ["ok"], "tokens_to_generate": 0, "logprobs": 1}, "logprobs", "true"),
        ("api", {"prompts": ["ok", ""]}, "prompts", "prompts[1] is empty"),
        ("api", {"prompts": ["é" * 20], "tokens_to_generate": 60}, "prompts",
         "100 > the server's maximum"),
        ("api", {"prompts": ["ok"], "temperature": 101}, "temperature", "(0.0, 100.0]"),
        ("api", {"prompts": ["ok"], "top_k": 1001}, "top_k", "0..1000"),
        ("api", {"prompts": ["ok"], "top_p": 0.5, "top_k": 1}, "top_k", "both be > 0"),
        ("api", {"prompts": ["ok"], "top_p": 1.5}, "top_p", "[0.0, 1.0]"),
        ("api", {"prompts": ["ok"], "stop_on_eol": True}, "stop_on_eol", "ignores it"),
        ("api", {"prompts": ["ok"], "length_penalty": 1}, "length_penalty", "1.0 or left out"),
        ("api", {"prompts": ["ok"], "max_len": 4}, "max_len", "tokens_to_generate"),
        ("completions", {"max_tokens": 1}, "prompt", "prompt is required"),
        ("completions", {"prompt": [[1, 2]], "max_tokens": 1}, "prompt", "a list of strings"),
        ("completions", {"prompt": "x", "max_tokens": 1, "top_k": 1.5}, "top_k", "integer"),
        ("completions", {"prompt": "x", "max_tokens": 1, "seed": False}, "seed", "integer"),
        ("completions", {"prompt": "x", "max_tokens": 1, "seed": 2 ** 24 + 1}, "seed", "1.."),
        ("completions", {"prompt": "x", "max_tokens": 1, "top_p": "1"}, "top_p", "a number"),
        ("completions", {"prompt": "x", "max_tokens": 1, "top_p": float("nan")}, "top_p", "nan"),
        ("completions", {"prompt": "x", "max_tokens": 1, "top_k": 3}, "top_k",
         "top_p is 1.0 by default here: send top_p: 0 with top_k"),
        ("completions", {"prompt": "x", "max_tokens": 1, "stop": [1]}, "stop", "strings"),
        ("completions", {"prompt": "x", "max_tokens": 1, "stream": True}, "stream", "False"),
        ("completions", {"prompt": "x", "max_tokens": 1, "echo": "yes"}, "echo", "true or false"),
        ("completions", {"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 11},
         "logprobs", "0..10"),
        ("openai", {"prompt": [1, 256]}, "prompt", "0..255"),
        ("openai", {"prompt": [[]]}, "prompt", "prompt[0] is empty"),
        ("openai", {"prompt": [1.5]}, "prompt", "token ids"),
        ("openai", {"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
        ("openai", {"prompt": "x", "max_tokens": 99}, "prompt", "100 > the server's maximum"),
        ("openai", {"prompt": "x", "logprobs": 2, "echo": True}, "logprobs", "echo"),
        ("openai", {"prompt": "x", "seed": 3}, "seed", "ignores it"),
        ("openai", {"prompt": "x", "top_k": 5}, "top_k", "send top_p: 0"),
        ("openai", {"prompt": ["x"] * 5}, "prompt", "at most 4"),
    ],
)
def test_request_guard_names_what_is_wrong(dialect, body, field, problem):
    """The guard's verdict on single bad requests: the field it names and why (2-byte characters
    count as 2 tokens)."""
    from megatron_tokenweave.serving.guard import Limits, request_problem
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    got = request_problem(dialect, body, ByteTokenizer(), Limits(**GUARD_LIMITS))
    assert got is not None and got.field == field and problem in got.message, got
    assert got.body() == {"error": got.message, "field": field}


@pytest.mark.parametrize(
    ("dialect", "body"),
    [
        ("api", {"prompts": ["hello"]}),
        ("api", {"prompts": ["a", "b"], "tokens_to_generate": 0, "logprobs": True}),
        ("api", {"prompts": ["a"], "top_p": 0.9, "temperature": 0.5, "add_BOS": False,
                 "stop_token": 50256, "length_penalty": 1.0}),
        ("completions", {"prompt": "hello", "max_tokens": 8, "temperature": 0, "top_p": 1}),
        ("completions", {"prompt": "hello", "max_tokens": 8, "temperature": 0, "top_k": 7}),
        ("completions", {"prompt": ["a", "b"], "max_tokens": 98}),
        ("completions", {"prompt": "a", "max_tokens": 4, "top_k": 5, "top_p": 0, "seed": 9,
                         "n": 1, "stream": False, "stop": "\n", "model": "any"}),
        ("completions", {"prompt": "a", "max_tokens": 0, "echo": True, "logprobs": 10}),
        ("openai", {"prompt": "hello"}),
        ("openai", {"prompt": [[1, 2], [3]], "max_tokens": 97, "logprobs": 3, "ignore_eos": True}),
        ("openai", {"prompt": [104, 105], "temperature": 0.7, "top_p": 0.9, "n": 1.0}),
    ],
)
def test_request_guard_accepts_good_requests(dialect, body):
    from megatron_tokenweave.serving.guard import Limits, request_problem
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    assert request_problem(dialect, body, ByteTokenizer(), Limits(**GUARD_LIMITS)) is None


def test_request_guard_keeps_the_first_forward_in_the_workspace():
    """The static engine's first forward runs every prompt up to the shortest one's length (its
    whole length when nothing is generated; every slot of the batch under CUDA graphs): more
    rows than the TokenWeave workspace holds are refused before the engine sees them."""
    from megatron_tokenweave.serving.guard import Limits, request_problem
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    limits = Limits(**GUARD_LIMITS, max_prefill_tokens=40)
    tok = ByteTokenizer()
    check = lambda body, lim=limits: request_problem("api", body, tok, lim)  # noqa: E731
    assert check({"prompts": ["x" * 10, "y" * 30], "tokens_to_generate": 4}) is None  # 2 x 10
    assert check({"prompts": ["x" * 25, "y" * 30], "tokens_to_generate": 4}).field == "prompts"
    refusal = check({"prompts": ["x" * 10, "y" * 30], "tokens_to_generate": 0, "logprobs": True})
    assert refusal is not None and "60 tokens" in refusal.message  # 2 x 30
    padded = Limits(**GUARD_LIMITS, max_prefill_tokens=40, pads_batch=True)
    assert "44 tokens" in check({"prompts": ["x" * 11], "tokens_to_generate": 4},
                                padded).message  # 4 x 11


def _pretend_gpu(monkeypatch, capability: tuple[int, int], fa3: bool, fa4: bool) -> None:
    from megatron.core.transformer import attention

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(attention, "HAVE_FA3", fa3, raising=False)
    monkeypatch.setattr(attention, "HAVE_FA4", fa4, raising=False)


def test_dynamic_engine_config_for_flash_attn_4_on_sm90(monkeypatch):
    """flash-attn-4 alone on SM 9.0: the dynamic engine needs batch-invariant attention (no
    split-KV); a config without it is refused with the fields it needs, one with it accepted."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_tokenweave.models import llama_config
    from megatron_tokenweave.serving.engines import (
        dynamic_config_overrides,
        dynamic_engine_problem,
    )

    _pretend_gpu(monkeypatch, (9, 0), fa3=False, fa4=True)
    overrides = dynamic_config_overrides()
    assert overrides == dict(batch_invariant_mode=True, attention_backend=AttnBackend.flash,
                             flash_attention_version=4)
    assert dynamic_engine_problem() is None
    stock = llama_config(SHAPE, 1, 1)
    problem = dynamic_engine_problem(stock)
    assert problem is not None and "batch_invariant_mode" in problem
    assert dynamic_engine_problem(llama_config(SHAPE, 1, 1, **overrides)) is None


@pytest.mark.parametrize("capability, fa3, fa4, needs", [
    ((9, 0), True, False, None),   # FA3 on Hopper: Megatron's defaults
    ((10, 0), False, True, None),  # flash-attn-4 on Blackwell has split-KV
    ((9, 0), False, False, "needs flash-attn"),
])
def test_dynamic_engine_config_elsewhere(monkeypatch, capability, fa3, fa4, needs):
    from megatron_tokenweave.models import llama_config
    from megatron_tokenweave.serving.engines import (
        dynamic_config_overrides,
        dynamic_engine_problem,
    )

    _pretend_gpu(monkeypatch, capability, fa3, fa4)
    assert dynamic_config_overrides() == {}
    problem = dynamic_engine_problem(llama_config(SHAPE, 1, 1))
    assert problem is None if needs is None else needs in problem


def test_dynamic_engine_refuses_without_cuda():
    from megatron_tokenweave.serving.engines import dynamic_config_overrides, dynamic_engine_problem

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert dynamic_config_overrides() == {}
    assert "needs CUDA" in dynamic_engine_problem()


def test_models_of_two_attention_backends_in_one_process(monkeypatch, single_rank_group):
    """Megatron's GPTModel pins TE's attention env vars from its config and refuses a model of
    another backend later in the process; clear_attention_backend_env() lets tests and
    benchmarks build both (the dynamic engine's pair after the static engine's)."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_tokenweave.cpu_compat import cpu_device_scope
    from megatron_tokenweave.models import (
        TE_ATTENTION_ENV,
        build_gpt,
        clear_attention_backend_env,
        llama_config,
        stock_layer_spec,
    )

    for name in TE_ATTENTION_ENV:
        monkeypatch.setenv(name, "x")  # so that monkeypatch restores the original state
        monkeypatch.delenv(name)
    spec = stock_layer_spec(SHAPE, use_te=False)
    with cpu_device_scope():
        build_gpt(llama_config(SHAPE, 1, 1), spec, SHAPE.vocab, 16)
        flash = llama_config(SHAPE, 1, 1, attention_backend=AttnBackend.flash)
        with pytest.raises(AssertionError, match="NVTE_FUSED_ATTN"):
            build_gpt(flash, spec, SHAPE.vocab, 16)
        clear_attention_backend_env()
        build_gpt(flash, spec, SHAPE.vocab, 16)
    assert os.environ["NVTE_FUSED_ATTN"] == "0"


def test_dynamic_engine_cuda_graph_config(monkeypatch):
    """Megatron's inference CUDA graphs: the config fields come with a scope, a bad scope is
    refused, and dynamic_llm refuses cuda_graphs for a model built without them."""
    from megatron.core.transformer.enums import InferenceCudaGraphScope

    from megatron_tokenweave.models import llama_config
    from megatron_tokenweave.serving.engines import dynamic_config_overrides, dynamic_llm

    _pretend_gpu(monkeypatch, (9, 0), fa3=False, fa4=True)
    for scope in ("layer", "block"):
        overrides = dynamic_config_overrides(scope)
        assert overrides["cuda_graph_impl"] == "local"
        assert overrides["inference_cuda_graph_scope"] is InferenceCudaGraphScope[scope]
        assert overrides["batch_invariant_mode"] is True
    with pytest.raises(ValueError, match="cuda_graph_scope"):
        dynamic_config_overrides("everything")

    class Model:
        config = llama_config(SHAPE, 1, 1, **dynamic_config_overrides())

    with pytest.raises(ValueError, match="cuda_graphs needs a model built with"):
        dynamic_llm(Model(), None, 64, 2, cuda_graphs=4)


def _kernel_failure_stops_the_server(rank: int, world: int) -> str:
    """A TokenWeave model served on every rank whose communicator check (watch_failures) reports
    a kernel failure on the request with the POISON byte, as every rank does after a peer's
    kernel gave up (the check is collective). Rank 0 sends that request; then every rank's
    serve_forever must raise instead of serving on."""
    import threading
    import time

    from _serving import POISON, http

    from megatron_tokenweave.communicator import KernelFailure
    from megatron_tokenweave.cpu_compat import cpu_inference_scope
    from megatron_tokenweave.launch import stop_event
    from megatron_tokenweave.serving import engines
    from megatron_tokenweave.serving.http import FlaskTextServer
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    setup_tp(world)
    tw_config = TokenWeaveConfig(split_threshold=THRESHOLD, split_align=1, tuning_table="none")
    model = build_model("tokenweave", SHAPE, LAYERS, world, tw_config, max_seq=MAX_SEQ)
    seen = [False]

    def look(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen[0] = ids is not None and bool((ids == POISON).any())

    def failed() -> None:
        if seen[0]:
            raise KernelFailure("tokenweave kernel on rank 1: peer rank 0 never arrived (test)")

    model.embedding.register_forward_pre_hook(look, with_kwargs=True)
    engines.kernels_live, engines.raise_if_any_failed = (lambda: True), failed
    with cpu_inference_scope():
        server = FlaskTextServer(engines.static_engine(model, ByteTokenizer(SHAPE.vocab),
                                                       MAX_BATCH, MAX_SEQ), port=0)
        if rank == 0:  # the port is bound: the request waits until the server runs

            def poisoned_request_then_stop() -> None:
                body = json.dumps({"prompts": [f"{chr(POISON)} x"], "tokens_to_generate": 2,
                                   "top_k": 1}).encode()
                http(server.url + "/api", "PUT", body, timeout=60.0)
                time.sleep(30.0)  # bounded: a server that served on stops here
                stop_event().set()

            threading.Thread(target=poisoned_request_then_stop, daemon=True).start()
        try:
            server.serve_forever()
        except KernelFailure as exc:
            return f"raised: {exc}"
    return "served on"


def test_a_kernel_failure_stops_every_rank_of_the_flask_server():
    """Not a request error: every rank leaves serve_forever with the KernelFailure (the
    launcher then reports it and stops the job) instead of answering later requests."""
    results = run_ranks(_kernel_failure_stops_the_server)
    for rank, result in enumerate(results):
        assert result.startswith("raised: tokenweave kernel on rank 1"), (rank, result)

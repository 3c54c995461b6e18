"""Megatron's inference stack with the TokenWeave spec on 2 gloo ranks (TP=2, fp32, reference
path): the static engine's greedy generations and the Flask text generation server's answers
over real HTTP equal those of the stock local spec with the same weights; the server answers
malformed requests with HTTP 400 and keeps serving.

One spawned job runs everything; the tests assert on what the ranks returned.
"""

from __future__ import annotations

import os

import pytest
import torch
from _dist import build_model, randomize_norms_, record_fused_calls, run_ranks, setup_tp
from _serving import check_server_answers, serve_and_query

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.launch import free_port
from megatron_tokenweave.models import SHAPES

SHAPE = SHAPES["tiny"]  # vocab 256: every generated id is a byte
LAYERS = 3
THRESHOLD = 16
MAX_BATCH, MAX_SEQ = 4, 96
NEW_TOKENS = 12
PROMPTS = ["The quick brown fox", "TokenWeave: overlap!", "tensor parallel", "a"]
def _serving_worker(rank: int, world: int, ports: list[int]) -> dict:
    from megatron_tokenweave.cpu_compat import cpu_inference_scope
    from megatron_tokenweave.serving.engines import generated_tokens, greedy, static_engine
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    setup_tp(world)
    tw_config = TokenWeaveConfig(split_threshold=THRESHOLD, split_align=1, tuning_table="none")
    stock = build_model("stock", SHAPE, LAYERS, world, max_seq=MAX_SEQ)
    randomize_norms_(stock, seed=11)
    woven = build_model("tokenweave", SHAPE, LAYERS, world, tw_config, max_seq=MAX_SEQ)
    woven.load_state_dict(stock.state_dict(), strict=True)
    tokenizer = ByteTokenizer(SHAPE.vocab)
    out: dict = {}
    with cpu_inference_scope():
        for name, model in (("stock", stock), ("tokenweave", woven)):
            engine = static_engine(model, tokenizer, MAX_BATCH, MAX_SEQ)
            with record_fused_calls() as calls:
                requests = engine.generate(prompts=PROMPTS, sampling_params=greedy(NEW_TOKENS))
            out[name] = dict(tokens=generated_tokens(requests),
                             text=[r.generated_text for r in requests], calls=list(calls))
            out[name]["http"] = serve_and_query(engine, ports[name == "tokenweave"], PROMPTS,
                                                NEW_TOKENS, MAX_BATCH, MAX_SEQ)
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(_serving_worker, [free_port(), free_port()])


def test_static_engine_greedy_tokens_match_stock(per_rank):
    """Greedy generation through Megatron's static engine: the same tokens and text with the
    TokenWeave spec as with the stock spec, on every rank, for prompts of mixed lengths."""
    for result in per_rank:
        stock, woven = result["stock"], result["tokenweave"]
        assert len(stock["tokens"]) == len(PROMPTS)
        assert all(0 < len(t) <= NEW_TOKENS for t in stock["tokens"])
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
    malformed request gets HTTP 400 with a message and the next good request is answered exactly
    as before (no rank was left in a collective)."""
    check_server_answers(per_rank[0]["stock"]["http"], per_rank[0]["tokenweave"]["http"],
                         per_rank[0]["tokenweave"]["tokens"], PROMPTS, MAX_BATCH, MAX_SEQ)


def test_tokenizer_round_trip():
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    tok = ByteTokenizer(1000)
    text = "héllo, wörld"
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.detokenize([104, 300, 105]) == "h<300>i"
    with pytest.raises(ValueError, match="at least 256"):
        ByteTokenizer(100)
    assert torch.tensor(tok.offsets([104, 300, 105], "h<300>i")).tolist() == [0, 1, 6]


@pytest.mark.parametrize(
    ("path", "body", "problem"),
    [
        ("/api", None, "JSON object"),
        ("/api", [1, 2], "JSON object"),
        ("/api", {}, "prompts is required"),
        ("/api", {"prompts": [1]}, "list of strings"),
        ("/api", {"prompts": ["ok"], "tokens_to_generate": True}, "integer >= 0"),
        ("/api", {"prompts": ["ok"], "tokens_to_generate": 2.5}, "integer >= 0"),
        ("/api", {"prompts": ["ok", ""]}, "prompt 1 is empty"),
        ("/api", {"prompts": ["é" * 20], "tokens_to_generate": 60}, "100 > the server's maximum"),
        ("/completions", {"max_tokens": 1}, "prompt is required"),
        ("/completions", {"prompt": [[1, 2]], "max_tokens": 1}, "list of strings"),
        ("/completions", {"prompt": "x", "max_tokens": 1, "top_k": 1.5}, "top_k must be an int"),
        ("/completions", {"prompt": "x", "max_tokens": 1, "seed": False}, "seed must be an int"),
        ("/completions", {"prompt": "x", "max_tokens": 1, "top_p": "1"}, "top_p must be a num"),
    ],
)
def test_request_problem_names_what_is_wrong(path, body, problem):
    """The guard's verdict on single malformed requests (2-byte characters count as 2 tokens)."""
    from megatron_tokenweave.serving.http import request_problem
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    got = request_problem(path, body, ByteTokenizer(), max_batch_size=4, max_sequence_length=99)
    assert got is not None and problem in got, got


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api", {"prompts": ["hello"]}),
        ("/api/", {"prompts": ["a", "b"], "tokens_to_generate": 0, "logprobs": True}),
        ("/completions", {"prompt": "hello", "max_tokens": 8, "temperature": 0, "top_p": 1}),
        ("/completions", {"prompt": ["a", "b"], "max_tokens": 93}),
    ],
)
def test_request_problem_accepts_good_requests(path, body):
    from megatron_tokenweave.serving.http import request_problem
    from megatron_tokenweave.serving.tokenizer import ByteTokenizer

    assert request_problem(path, body, ByteTokenizer(), 4, 99) is None


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

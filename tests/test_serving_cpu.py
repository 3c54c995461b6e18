"""Megatron's inference stack with the TokenWeave spec on 2 gloo ranks (TP=2, fp32, reference
path): the static engine's greedy generations and the Flask text generation server's answers
over real HTTP equal those of the stock local spec with the same weights; the server answers
malformed requests with HTTP 400 and keeps serving.

One spawned job runs everything; the tests assert on what the ranks returned.
"""

from __future__ import annotations

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

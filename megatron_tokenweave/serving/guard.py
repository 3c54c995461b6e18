"""The request guard in front of Megatron's text generation servers.

Megatron's handlers check some fields, answer some bad ones with HTTP 200 and a bare string, and
cast the rest unchecked; its engines assert on what gets through (top_k together with top_p,
top_k beyond the vocabulary, a prompt plus generation longer than the KV cache, ...). Such an
assertion fails the request on every rank, and the engine is left holding it (the static engine)
or stops (the dynamic engine's loop). The guard refuses every such request with HTTP 400 and
`{"error": message, "field": name}` before any rank sees it. Three dialects:

* "api": Megatron's PUT /api (MegatronGenerate, static engine)
* "completions": Megatron's POST /completions (MegatronCompletions, static engine)
* "openai": Megatron's OpenAI-style POST /v1/completions (dynamic engine)

Fields Megatron's engines would silently ignore are refused unless they ask for what happens
anyway, so that no reply is silently not what was asked for.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

MEGATRON_MAX_PROMPTS = 128  # MegatronGenerate refuses more
MEGATRON_MAX_TOP_K = 1000  # MegatronGenerate's bound
MAX_TOP_LOGPROBS = {"completions": 10, "openai": 20}
FLOAT32_EXACT = 2 ** 24  # run_mcore_engine sends the seed to the other ranks as float32
DEFAULT_TOKENS = {"api": 64, "openai": 16}  # Megatron's defaults; /completions requires it

# /api fields that Megatron-Core's engine ignores: accepted only with their default value.
_API_IGNORED = {"add_BOS": False, "stop_on_double_eol": False, "stop_on_eol": False,
                "prevent_newline_after_colon": False, "stop_token": 50256, "length_penalty": 1.0}
_API_GONE = {
    "max_len": "max_len is no longer used: send tokens_to_generate",
    "sentences": "sentences is no longer used: send prompts",
    "beam_width": "beam_width: beam search is not supported",
    "random_seed": "random_seed is ignored by /api: use POST /completions with seed",
    "top_p_decay": "top_p_decay is not supported by Megatron-Core's engine",
    "top_p_bound": "top_p_bound is not supported by Megatron-Core's engine",
}
# OpenAI-style fields that Megatron's handlers ignore: accepted only with their default value.
_OPENAI_IGNORED = {"n": 1, "best_of": 1, "stream": False, "presence_penalty": 0,
                   "frequency_penalty": 0}


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the engine behind a server."""

    max_prompts: int  # prompts in one request
    max_sequence_length: int  # prompt + generated tokens, per prompt
    vocab_size: int  # the model's: token ids and top_k stay below it
    max_prefill_tokens: int | None = None  # TokenWeave workspace rows (None: unbounded)
    pads_batch: bool = False  # CUDA graphs: every static-engine forward is max_prompts deep


class Refusal(Exception):
    """A request the engine must not see: HTTP 400 with `{"error": ..., "field": ...}`."""

    status = 400

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message

    def body(self) -> dict[str, Any]:
        return {"error": self.message, "field": self.field}


def _integer(body: dict, name: str, default: Any, lo: int, hi: int | None = None) -> int:
    value = body.get(name, default)
    if (isinstance(value, bool) or not isinstance(value, int) or value < lo
            or (hi is not None and value > hi)):
        bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise Refusal(name, f"{name} must be an integer {bound}, got {value!r}")
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float,
            above_lo: bool = False, floats_only: bool = False) -> float:
    value = body.get(name, default)
    kinds = (float,) if floats_only else (int, float)
    if (isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value)
            or value > hi or value < lo or (above_lo and value == lo)):
        what = "a float (with a decimal point)" if floats_only else "a number"
        raise Refusal(name, f"{name} must be {what} in {'(' if above_lo else '['}{lo}, {hi}], "
                            f"got {value!r}")
    return float(value)


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise Refusal(name, f"{name} must be true or false, got {value!r}")
    return value


def _only_default(body: dict, defaults: dict[str, Any], why: str, same_type: bool) -> None:
    """Fields that change nothing: refused unless they ask for the default (of its very type
    where Megatron's handler checks the type, `same_type`)."""
    for name, default in defaults.items():
        if name not in body:
            continue
        value = body[name]
        kind_ok = (type(value) is type(default) if same_type
                   else isinstance(value, bool) == isinstance(default, bool))
        if not kind_ok or value != default:
            raise Refusal(name, f"{name} must be {default!r} or left out ({why}), got {value!r}")


def _text_prompts(body: dict, key: str, tokenizer: Any, single_string: bool) -> list[list[int]]:
    prompts = body.get(key)
    if prompts is None:
        raise Refusal(key, f"{key} is required")
    if single_string and isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        shape = "a string or a list of strings" if single_string else "a list of strings"
        raise Refusal(key, f"{key} must be {shape}, got {type(prompts).__name__}")
    return [list(tokenizer.tokenize(p)) for p in prompts]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _openai_prompts(body: dict, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Megatron's OpenAI endpoint takes text, texts, token ids or lists of token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise Refusal("prompt", "prompt is required")
    if isinstance(prompt, str):
        return [list(tokenizer.tokenize(prompt))]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [list(tokenizer.tokenize(p)) for p in prompt]
    if _is_ids(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and all(_is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise Refusal("prompt", "prompt must be a string, a list of strings, a list of token "
                                "ids or a list of lists of token ids")
    if any(not 0 <= t < vocab_size for p in prompts for t in p):
        raise Refusal("prompt", f"prompt token ids must be in 0..{vocab_size - 1}")
    return prompts


def _check_prompts(key: str, prompts: list[list[int]], count_key: str, count: int,
                   limits: Limits) -> None:
    """Counts and lengths against the engine: its batch, KV cache and TokenWeave workspace."""
    if not prompts:
        raise Refusal(key, f"{key} is empty")
    if len(prompts) > limits.max_prompts:
        raise Refusal(key, f"{key} holds {len(prompts)} prompts; this server takes at most "
                           f"{limits.max_prompts} at once")
    for i, tokens in enumerate(prompts):
        if not tokens:
            raise Refusal(key, f"{key}[{i}] is empty")
        if len(tokens) + count > limits.max_sequence_length:
            raise Refusal(key, f"{key}[{i}] has {len(tokens)} tokens; with {count_key}={count} "
                               f"that is {len(tokens) + count} > the server's maximum sequence "
                               f"length {limits.max_sequence_length}")
    if limits.max_prefill_tokens is not None:
        # The static engine's first forward runs every prompt up to the shortest one's length
        # (all of each prompt when nothing is generated).
        depth = max(map(len, prompts)) if count == 0 else min(map(len, prompts))
        rows = (limits.max_prompts if limits.pads_batch else len(prompts)) * depth
        if rows > limits.max_prefill_tokens:
            raise Refusal(key, f"{key} make a first forward of {rows} tokens; this server's "
                               f"TokenWeave workspace holds {limits.max_prefill_tokens} "
                               f"(TOKENWEAVE_MAX_TOKENS)")


def _check_top_k(top_k: int, top_p: float, limits: Limits, top_p_default: str) -> None:
    if top_k >= limits.vocab_size:
        raise Refusal("top_k", f"top_k must be below the vocabulary size {limits.vocab_size}, "
                               f"got {top_k}")
    if top_k > 0 and top_p > 0:
        raise Refusal("top_k", f"top_k and top_p cannot both be > 0 (Megatron samples with one "
                               f"of them; top_p is {top_p}{top_p_default})")


def _check_api(body: dict, tokenizer: Any, limits: Limits) -> None:
    for name, message in _API_GONE.items():
        if name in body:
            raise Refusal(name, message)
    _only_default(body, _API_IGNORED, "Megatron-Core's engine ignores it", same_type=True)
    prompts = _text_prompts(body, "prompts", tokenizer, single_string=False)
    count = _integer(body, "tokens_to_generate", DEFAULT_TOKENS["api"], 0)
    if count == 0 and not _flag(body, "logprobs", False):
        raise Refusal("tokens_to_generate", "tokens_to_generate=0 only scores the prompts: "
                                            "send logprobs: true with it")
    _number(body, "temperature", 1.0, 0.0, 100.0, above_lo=True)
    top_k = _integer(body, "top_k", 0, 0, MEGATRON_MAX_TOP_K)
    top_p = _number(body, "top_p", 0.0, 0.0, 1.0, floats_only=True)
    _check_top_k(top_k, top_p, limits, "")
    _check_prompts("prompts", prompts, "tokens_to_generate", count, dataclasses.replace(
        limits, max_prompts=min(limits.max_prompts, MEGATRON_MAX_PROMPTS)))


def _check_sampling(body: dict, limits: Limits) -> None:
    """temperature/top_k/top_p of the OpenAI-style endpoints (top_p defaults to 1.0 there)."""
    temperature = _number(body, "temperature", 1.0, 0.0, 100.0)
    top_k = _integer(body, "top_k", 0, 0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if temperature > 0:  # temperature 0 is greedy: Megatron sets top_k=1, top_p=0
        _check_top_k(top_k, top_p, limits, " by default here: send top_p: 0 with top_k"
                     if "top_p" not in body else "")


def _check_stop(body: dict) -> None:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise Refusal("stop", "stop must be a string or a list of strings")


def _check_completions(body: dict, tokenizer: Any, limits: Limits) -> None:
    if "debug_fname" in body:
        raise Refusal("debug_fname", "debug_fname is not accepted (it writes files on the server)")
    _only_default(body, _OPENAI_IGNORED, "Megatron's /completions returns one completion, "
                                         "unstreamed, without penalties", same_type=False)
    prompts = _text_prompts(body, "prompt", tokenizer, single_string=True)
    if "max_tokens" not in body:
        raise Refusal("max_tokens", "max_tokens is required")
    count = _integer(body, "max_tokens", None, 0)
    echo = _flag(body, "echo", False)
    if count == 0 and not echo:
        raise Refusal("max_tokens", "max_tokens=0 only scores the prompt: send echo: true")
    top_logprobs = _integer(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS["completions"])
    if top_logprobs > 0 and count > 0:
        raise Refusal("logprobs", "logprobs > 0 (top log-probs) needs max_tokens=0")
    if "seed" in body:
        _integer(body, "seed", None, 1, FLOAT32_EXACT)
    _check_sampling(body, limits)
    _check_stop(body)
    _check_prompts("prompt", prompts, "max_tokens", count, limits)


def _check_openai(body: dict, tokenizer: Any, limits: Limits) -> None:
    _only_default(body, _OPENAI_IGNORED, "Megatron's /v1/completions returns one completion "
                                         "per prompt, unstreamed, without penalties",
                  same_type=False)
    if "seed" in body:
        raise Refusal("seed", "seed is not supported: Megatron's dynamic engine ignores it")
    prompts = _openai_prompts(body, tokenizer, limits.vocab_size)
    count = _integer(body, "max_tokens", DEFAULT_TOKENS["openai"], 1)
    echo = _flag(body, "echo", False)
    _flag(body, "ignore_eos", False)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS["openai"])
        if echo:  # prompt log-probs: the engine materializes only the last token's logits
            raise Refusal("logprobs", "logprobs with echo: true (prompt log-probs) is not "
                                      "supported by this engine")
    _check_sampling(body, limits)
    _check_stop(body)
    _check_prompts("prompt", prompts, "max_tokens", count, limits)


DIALECTS = {"api": _check_api, "completions": _check_completions, "openai": _check_openai}


def check_request(dialect: str, body: Any, tokenizer: Any, limits: Limits) -> None:
    """Raise Refusal when the engine behind `dialect`'s endpoint must not see `body` (the
    parsed JSON body; None when it was not JSON)."""
    if not isinstance(body, dict):
        raise Refusal(None, "the request body must be a JSON object "
                            "(Content-Type: application/json)")
    DIALECTS[dialect](body, tokenizer, limits)


def request_problem(dialect: str, body: Any, tokenizer: Any, limits: Limits) -> Refusal | None:
    """The Refusal of `body`, or None when the engine can take it."""
    try:
        check_request(dialect, body, tokenizer, limits)
    except Refusal as refusal:
        return refusal
    return None

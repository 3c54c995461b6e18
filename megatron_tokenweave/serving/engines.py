"""Megatron-Core inference engines around a GPTModel, built the way Megatron's own examples do.

The model may use any layer spec; a TokenWeave model is served exactly like a stock one. The one
addition: after every forward of an engine step, a kernel failure recorded by a TokenWeave
communicator on any rank (a peer rank that never arrived) is raised on every rank
(`watch_failures`), also where Megatron replays the layers as CUDA graphs and no layer's Python
runs; the servers treat it as fatal (the launcher stops every rank).
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import torch
from megatron.core.inference.sampling_params import SamplingParams

from megatron_tokenweave.communicator import kernels_live, raise_if_any_failed


def greedy(num_tokens: int, stop_at_eod: bool = True, **kwargs: Any) -> SamplingParams:
    """Greedy decoding (top-1) of `num_tokens` tokens. stop_at_eod=False: exactly `num_tokens`
    (benchmarks: every model does the same work), which the dynamic engine reads from
    termination_id=-1 and the static one from a `no_early_termination` attribute."""
    if not stop_at_eod:
        kwargs["termination_id"] = -1
    params = SamplingParams(top_k=1, num_tokens_to_generate=num_tokens, **kwargs)
    if not stop_at_eod:
        params.no_early_termination = True
    return params


def _raise_kernel_failure(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
    # The step's tokens need its logits on the host anyway: the sync costs the step little, and
    # every rank reads the error words and agrees before any token is sampled.
    if kernels_live():
        raise_if_any_failed()


def watch_failures(model: torch.nn.Module) -> None:
    """Raise on every rank, after each forward of `model`, a kernel failure any rank of a
    TokenWeave communicator recorded (KernelFailure naming the peer, the slot and the timeout):
    its outputs are NaN, and no token is sampled from them. Once per model; a model without
    TokenWeave kernels pays nothing."""
    if not getattr(model, "_tokenweave_watched", False):
        model.register_forward_hook(_raise_kernel_failure)
        model._tokenweave_watched = True


def static_engine(model: torch.nn.Module, tokenizer: Any, max_batch_size: int,
                  max_sequence_length: int):
    """Megatron's legacy static-batching engine: StaticInferenceContext (KV cache of
    max_batch_size x max_sequence_length), GPTInferenceWrapper, TextGenerationController."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    watch_failures(model)
    context = StaticInferenceContext(max_batch_size, max_sequence_length)
    controller = TextGenerationController(GPTInferenceWrapper(model, context), tokenizer)
    return StaticInferenceEngine(controller, max_batch_size=max_batch_size, legacy=True)


def _flash_attn_generations() -> tuple[bool, bool]:
    """(FA3, flash-attn-4) as Megatron's attention module detected them."""
    from megatron.core.transformer import attention

    return getattr(attention, "HAVE_FA3", False), getattr(attention, "HAVE_FA4", False)


def dynamic_config_overrides(cuda_graph_scope: str | None = None) -> dict[str, Any]:
    """TransformerConfig fields a model needs to run Megatron's dynamic engine on this machine,
    plus, with `cuda_graph_scope` ("layer" or "block"), those of Megatron's inference CUDA graphs
    (`cuda_graph_impl="local"`; pass `cuda_graphs=` to `dynamic_llm`).

    Megatron's dynamic attention passes `num_splits=0` (flash-attn's split-KV heuristic) unless
    `batch_invariant_mode` is set, when it passes `num_splits=1`; flash-attn-4 has no split-KV
    kernel on SM 9.0, so there the mode is needed, and it requires the flash backend with a pinned
    flash-attn generation. (In megatron-core 0.19.2 the dynamic engine's attention sees only
    num_splits change; TE's DotProductAttention, used by static paths, gets num_splits=1 and the
    flash backend too: tests and benchmarks build a separate model pair for the dynamic engine.)
    Megatron sets TE's attention env vars process-wide from these fields: see
    `models.clear_attention_backend_env`."""
    overrides: dict[str, Any] = {}
    if cuda_graph_scope is not None:
        from megatron.core.transformer.enums import InferenceCudaGraphScope

        if cuda_graph_scope not in ("layer", "block"):
            raise ValueError(
                f"cuda_graph_scope must be 'layer' or 'block', got {cuda_graph_scope!r}")
        overrides.update(cuda_graph_impl="local",
                         inference_cuda_graph_scope=InferenceCudaGraphScope[cuda_graph_scope])
    if not torch.cuda.is_available():
        return overrides
    fa3, fa4 = _flash_attn_generations()
    if fa4 and not fa3 and torch.cuda.get_device_capability() == (9, 0):
        from megatron.core.transformer.enums import AttnBackend

        overrides.update(batch_invariant_mode=True, attention_backend=AttnBackend.flash,
                         flash_attention_version=4)
    return overrides


def dynamic_engine_problem(config: Any = None) -> str | None:
    """Why Megatron's dynamic engine cannot run a model of `config` here (None when it can, as
    far as we know; without a config: whether any model built with `dynamic_config_overrides()`
    can)."""
    if not torch.cuda.is_available():
        return "Megatron's dynamic engine needs CUDA"
    fa3, fa4 = _flash_attn_generations()
    if not (fa3 or fa4):
        return "Megatron's dynamic engine needs flash-attn (FA3 or flash-attn-4)"
    if config is not None:
        missing = {k: v for k, v in dynamic_config_overrides().items()
                   if getattr(config, k, None) != v}
        if missing:
            return (f"flash-attn-4 on SM 9.0 runs Megatron's dynamic attention only without "
                    f"split-KV: build the model with {missing} (dynamic_config_overrides())")
    return None


def dynamic_llm(model: torch.nn.Module, tokenizer: Any, max_sequence_length: int,
                max_requests: int, chunk_tokens: int = 2048, buffer_size_gb: float = 20.0,
                serving: bool = False, cuda_graphs: int | None = None):
    """Megatron's dynamic engine behind its high-level API: paged KV cache, continuous batching,
    chunked prefill of `chunk_tokens` tokens per step. `MegatronLLM` in direct mode (every rank
    calls `generate` with the same prompts), or with `serving` a `MegatronAsyncLLM` with its
    coordinator, whose `serve()` starts Megatron's OpenAI-style HTTP server (/v1/completions).
    Needs CUDA and flash-attn (FA3 or flash-attn-4), as Megatron's dynamic context does, and
    a model built with `dynamic_config_overrides()`. `cuda_graphs`: up to that many inference
    CUDA graphs (Megatron's `num_cuda_graphs`; the model built with a `cuda_graph_scope`)."""
    from megatron.core.inference.apis import MegatronAsyncLLM, MegatronLLM
    from megatron.core.inference.config import InferenceConfig

    model_config = getattr(model, "config", None)
    if (problem := dynamic_engine_problem(model_config)) is not None:
        raise RuntimeError(problem)
    if cuda_graphs and getattr(model_config, "cuda_graph_impl", "none") != "local":
        raise ValueError("cuda_graphs needs a model built with "
                         "dynamic_config_overrides(cuda_graph_scope='layer' or 'block')")

    config = InferenceConfig(
        max_sequence_length=max_sequence_length,
        max_requests=max_requests,
        max_tokens=chunk_tokens,
        enable_chunked_prefill=True,
        buffer_size_gb=buffer_size_gb,
        num_cuda_graphs=cuda_graphs or None,
    )
    if serving and multiprocessing.get_start_method(allow_none=True) != "fork":
        # Megatron's HTTP frontends are multiprocessing.Process children handed the listening
        # socket as an inherited fd ("fd://N"), which only the fork start method passes on; in a
        # rank started by the spawn method, spawn is the default and the frontend dies with
        # "Bad file descriptor". The frontends touch no CUDA. Process-wide: later
        # multiprocessing users in this rank fork too (Megatron's coordinator uses its own spawn
        # context).
        multiprocessing.set_start_method("fork", force=True)
    watch_failures(model)
    api = MegatronAsyncLLM if serving else MegatronLLM
    return api(model=model, tokenizer=tokenizer, inference_config=config, use_coordinator=serving)


def generated_tokens(requests: Any) -> list[list[int]]:
    """The generated token ids of each finished request, in order."""
    out = []
    for request in requests:
        tokens = request.generated_tokens
        out.append(tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens))
    return out

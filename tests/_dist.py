"""Helpers for the multi-rank CPU tests: run inside ranks started by `launch.spawn` (gloo).

Each test function spawns ONE job (2 ranks unless it asks for another TP size) that runs all of
its cases and returns small picklable results (max errors, call records) to the parent, which
asserts on them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from megatron_tokenweave.launch import spawn

WORLD = 2  # the TP size of a multi-rank test that does not ask for another
# What every CPU rank imports: the fork server's (launch.spawn's preload).
PRELOAD = ("torch", "megatron.core.models.gpt", "megatron.core.inference.contexts")


def run_ranks(fn, *args: Any, world: int = WORLD) -> list[Any]:
    """fn(rank, world, *args) on `world` gloo ranks (TP=world); the per-rank return values.

    Where the ranks outnumber the CPU cores, each rank runs torch with one intra-op thread: on a
    2-core machine 4 or 8 ranks of 2 threads each spend most of their time switching, and a
    collective waits for its slowest rank (about 10x slower forwards, measured at TP=4).
    Without a GPU the ranks come from a fork server that imported torch and Megatron once
    (importing them takes a rank about 8 s of CPU)."""
    preload = () if torch.cuda.is_available() else PRELOAD
    return spawn(_in_rank, world, rank_threads(world), fn, *args, preload=preload)


def rank_threads(world: int) -> int | None:
    """Intra-op threads a rank of a `world`-rank job runs with (None: torch's default)."""
    return 1 if world > (os.cpu_count() or 1) else None


def _in_rank(rank: int, world: int, threads: int | None, fn, *args: Any) -> Any:
    if threads is not None:
        torch.set_num_threads(threads)
    return fn(rank, world, *args)


def setup_tp(world: int, pipeline: int = 1) -> None:
    """Megatron's parallel state at TP=world / pipeline (call once per spawned rank)."""
    from megatron_tokenweave.launch import initialize_model_parallel

    initialize_model_parallel(world // pipeline, pipeline_model_parallel_size=pipeline)


@contextlib.contextmanager
def record_fused_calls() -> Iterator[list[tuple[int, int]]]:
    """Record (chunks, rows) of every fused op the woven layer makes, once per op (a
    copy-engine op issued as a transfer and a reduction counts at its reduction)."""
    from megatron_tokenweave.communicator import Communicator

    calls: list[tuple[int, int]] = []
    original = Communicator.allreduce_rmsnorm

    def counting(self, partial, *args, **kwargs):
        if kwargs.get("phase", "whole") != "transfer":
            calls.append((int(partial.shape[0]), int(partial.shape[1])))
        return original(self, partial, *args, **kwargs)

    Communicator.allreduce_rmsnorm = counting
    try:
        yield calls
    finally:
        Communicator.allreduce_rmsnorm = original


@contextlib.contextmanager
def record_norms() -> Iterator[list[tuple[int | None, int]]]:
    """(norm weight's data_ptr, or None for add-only; the call number the kernels check) of
    every fused op the woven layers make, once per op."""
    from megatron_tokenweave.communicator import Communicator

    weights: list[tuple[int | None, int]] = []
    original = Communicator.allreduce_rmsnorm

    def recording(self, partial, residual, weight, *args, **kwargs):
        if kwargs.get("phase", "whole") != "transfer":
            weights.append((None if weight is None else weight.data_ptr(), kwargs.get("call")))
        return original(self, partial, residual, weight, *args, **kwargs)

    Communicator.allreduce_rmsnorm = recording
    try:
        yield weights
    finally:
        Communicator.allreduce_rmsnorm = original


@contextlib.contextmanager
def record_gemm_calls() -> Iterator[list[tuple]]:
    """Record the GEMM-fused mechanism's calls in order: ("gemm", set, row0, rows, total, call)
    for each communicating GEMM (Communicator.row_gemm) and ("reduce", set, row0, rows, total,
    call) for each consumer (allreduce_rmsnorm with comm="gemm"); `call`: the call number
    the kernels check."""
    from megatron_tokenweave.communicator import Communicator

    calls: list[tuple] = []
    gemm, fused = Communicator.row_gemm, Communicator.allreduce_rmsnorm

    def row_gemm(self, x, weight, bias, seg, set_index, **kwargs):
        calls.append(("gemm", set_index, seg.row0, seg.rows, seg.total, kwargs.get("call", 0)))
        return gemm(self, x, weight, bias, seg, set_index, **kwargs)

    def allreduce(self, *args, **kwargs):
        seg = kwargs.get("segments")
        if kwargs.get("comm") == "gemm" and seg is not None:
            calls.append(("reduce", kwargs.get("set_index", 0), seg.row0, seg.rows, seg.total,
                          kwargs.get("call", 0)))
        return fused(self, *args, **kwargs)

    Communicator.row_gemm, Communicator.allreduce_rmsnorm = row_gemm, allreduce
    try:
        yield calls
    finally:
        Communicator.row_gemm, Communicator.allreduce_rmsnorm = gemm, fused


@contextlib.contextmanager
def record_collective_calls() -> Iterator[list[int]]:
    """Record the rows of every fused-op call carried out by collectives (comm="collectives")."""
    import megatron_tokenweave.communicator as comm_mod

    calls: list[int] = []
    original = comm_mod.allreduce_add_rmsnorm_collectives

    def counting(partial, *args, **kwargs):
        calls.append(int(partial.shape[1]))
        return original(partial, *args, **kwargs)

    comm_mod.allreduce_add_rmsnorm_collectives = counting
    try:
        yield calls
    finally:
        comm_mod.allreduce_add_rmsnorm_collectives = original


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's boolean causal mask (True = masked), built on the CPU."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]


def build_model(spec_kind: str, shape, layers: int, world: int, tokenweave_config=None,
                max_seq: int = 2048, tied: bool = False, spec_kwargs: dict | None = None,
                model_kwargs: dict | None = None, **config_overrides: Any):
    """A GPTModel with the stock local spec ("stock"), the tokenweave layer spec ("tokenweave")
    or the tokenweave decoder block spec ("tokenweave_block"); in eval mode, on the CPU.
    spec_kwargs go to Megatron's spec function (e.g. num_experts), model_kwargs to GPTModel
    (pre_process, post_process)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_tokenweave.cpu_compat import cpu_device_scope
    from megatron_tokenweave.models import build_gpt, llama_config
    from megatron_tokenweave.spec import (
        get_gpt_decoder_block_tokenweave_spec,
        get_gpt_layer_tokenweave_spec,
    )

    norm = config_overrides.get("normalization", "RMSNorm")
    spec_kwargs = {"normalization": norm, **(spec_kwargs or {})}
    with cpu_device_scope():
        config = llama_config(shape, layers, world, **config_overrides)
        if spec_kind == "stock":
            spec = get_gpt_layer_local_spec(**spec_kwargs)
        elif spec_kind == "tokenweave":
            spec = get_gpt_layer_tokenweave_spec(
                False, tokenweave_config=tokenweave_config, **spec_kwargs
            )
        elif spec_kind == "tokenweave_block":
            spec = get_gpt_decoder_block_tokenweave_spec(
                config, False, tokenweave_config=tokenweave_config, **spec_kwargs
            )
        else:
            raise ValueError(spec_kind)
        return build_gpt(config, spec, shape.vocab, max_seq, tied=tied, **(model_kwargs or {}))


def build_hybrid_model(spec_kind: str, shape, pattern: str, world: int, tokenweave_config=None,
                       max_seq: int = 2048, spec=None, model_kwargs: dict | None = None,
                       **config_overrides: Any):
    """A HybridModel of `pattern` on the CPU: the stock hybrid stack on Megatron's local modules
    ("stock", megatron_tokenweave.hybrid.local_hybrid_stack_spec) or the TokenWeave hybrid stack
    spec, local flavour ("tokenweave"), unless `spec` is given; in eval mode. model_kwargs go to
    HybridModel (pre_process, post_process)."""
    from megatron_tokenweave.cpu_compat import cpu_device_scope
    from megatron_tokenweave.hybrid import get_hybrid_stack_tokenweave_spec, local_hybrid_stack_spec
    from megatron_tokenweave.models import build_hybrid, llama_config, pattern_layers

    if spec is None:
        if spec_kind == "stock":
            spec = local_hybrid_stack_spec()
        elif spec_kind == "tokenweave":
            spec = get_hybrid_stack_tokenweave_spec(False, tokenweave_config)
        else:
            raise ValueError(spec_kind)
    with cpu_device_scope():
        config = llama_config(shape, pattern_layers(pattern), world, is_hybrid_model=True,
                              **config_overrides)
        return build_hybrid(config, spec, shape.vocab, max_seq, pattern, **(model_kwargs or {}))


def same_router_on_every_rank_(model: torch.nn.Module) -> None:
    """Router weights are replicated across TP ranks in any checkpoint; Megatron's random CPU init
    draws them per rank, so make them equal as a loaded model has them."""
    import torch.distributed as dist

    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".router." in name:
                dist.broadcast(param, src=0)


def randomize_norms_(model: torch.nn.Module, seed: int) -> None:
    """Random norm weights around 1 (they start as all ones), the same on every rank (norm weights
    are replicated across TP ranks): every `*layernorm*` parameter and every `*norm.weight`.
    The linears keep Megatron's random init, sharded by rank."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "layernorm" in name or name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))


def forward(model, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Logits of `tokens` [b, s] with positions 0..s-1 and an explicit causal mask."""
    from megatron_tokenweave.cpu_compat import cpu_device_scope

    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    with cpu_device_scope(), torch.no_grad():
        return model(tokens, positions, attention_mask=causal_mask(seq), **kwargs)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (inf when shapes differ or got has NaN)."""
    if got.shape != want.shape:
        return float("inf")
    diff = (got.double() - want.double()).abs().max().item()
    if diff != diff:
        return float("inf")
    return diff / max(want.double().abs().max().item(), 1e-30)

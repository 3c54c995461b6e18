"""MoE layers in the woven schedule: Megatron's MoELayer with the all-gather token dispatcher.

The woven layer hands the MoE layer every token of a half (already gathered: the normed rows of
all chunks), so the dispatcher's own all-gather is not needed, and it takes the experts'
un-reduced output, so the dispatcher's reduce-scatter is replaced by the fused op. Both are the
dispatcher's TP collectives, skipped by presenting it a TP size of 1 for the call. The router
then runs on all tokens on every rank: its weights are replicated across TP ranks (as in any
checkpoint), so every rank routes alike. A model whose ranks hold different router weights (a
fresh random init on CPU does) would route differently here than in the stock layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


def is_moe(mlp: torch.nn.Module) -> bool:
    return isinstance(mlp, MoELayer)


def unsupported_reason(layer: MoELayer) -> str | None:
    """Why this MoE layer cannot be woven (None when it can)."""
    config = layer.config
    dispatcher = layer.token_dispatcher
    if type(dispatcher) is not MoEAllGatherTokenDispatcher:
        return f"MoE dispatcher {type(dispatcher).__name__} (woven: allgather only)"
    if dispatcher.ep_size != 1:
        return "MoE with expert parallelism"
    if getattr(layer, "use_shared_expert", False):
        return "MoE with shared experts"
    if config.moe_expert_capacity_factor is not None:
        return "MoE with an expert capacity factor (token dropping)"
    if getattr(config, "moe_latent_size", None):
        return "latent MoE"
    etp = getattr(config, "expert_tensor_parallel_size", None)
    if etp not in (None, config.tensor_model_parallel_size):
        return "expert tensor parallelism different from tensor parallelism"
    return None


@contextlib.contextmanager
def local_dispatch(layer: MoELayer) -> Iterator[None]:
    """The dispatcher skips its TP all-gather and reduce-scatter for the duration."""
    dispatcher = layer.token_dispatcher
    saved = dispatcher.tp_size
    dispatcher.tp_size = 1
    try:
        yield
    finally:
        dispatcher.tp_size = saved


def moe_partial(layer: MoELayer, x: torch.Tensor, partial: torch.Tensor) -> None:
    """partial[C, r, H] <- this rank's un-reduced MoE output of the tokens x[C, r, H]."""
    with local_dispatch(layer):
        out, bias = layer(x.contiguous())
    if bias is not None:
        raise NotImplementedError("MoE output bias")
    partial.copy_(out.view_as(partial))

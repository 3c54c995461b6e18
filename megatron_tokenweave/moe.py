"""MoE layers in the woven schedule: Megatron's MoELayer with a token dispatcher that drops nothing.

Two of Megatron's dispatchers (expert parallelism 1, expert TP = TP):
- all-gather, dropless: the reference MoE; it copies token counts to the host (eager only);
- all-to-all in drop-and-pad mode with a capacity of exactly the tokens (capacity factor
  experts / top-k): every expert computes a fixed [tokens, H] block, no host sync, so a CUDA
  graph can capture it; the padded rows cost experts / top-k x the routed FLOPs.
Token dropping (a smaller capacity) is refused: which tokens an expert drops depends on the batch
it sees, and the split hands it half a batch, so outputs would differ from the stock layer's.

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
from megatron.core.transformer.moe.moe_utils import get_capacity
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)

from megatron_tokenweave.ops.validate import TokenWeaveInputError


def is_moe(mlp: torch.nn.Module) -> bool:
    return isinstance(mlp, MoELayer)


def padded(layer: MoELayer) -> bool:
    """The all-to-all dispatcher in drop-and-pad mode (what the dispatcher itself was built
    with): fixed shapes, no host sync, so the layer can be captured in a CUDA graph."""
    dispatcher = layer.token_dispatcher
    return type(dispatcher) is MoEAlltoAllTokenDispatcher and bool(
        getattr(dispatcher, "drop_and_pad", False))


def unsupported_reason(layer: MoELayer) -> str | None:
    """Why this MoE layer cannot be woven (None when it can)."""
    config = layer.config
    dispatcher = layer.token_dispatcher
    kind = type(dispatcher)
    if kind is MoEAlltoAllTokenDispatcher and not padded(layer):
        return ("MoE all-to-all dispatcher without moe_pad_expert_input_to_capacity (woven: "
                "all-gather, or all-to-all in drop-and-pad mode)")
    if kind not in (MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher):
        return f"MoE dispatcher {kind.__name__} (woven: allgather, or alltoall drop-and-pad)"
    if dispatcher.ep_size != 1:
        return "MoE with expert parallelism"
    if getattr(layer, "use_shared_expert", False):
        return "MoE with shared experts"
    factor = config.moe_expert_capacity_factor
    if factor is not None and factor * config.moe_router_topk < config.num_moe_experts:
        return (f"MoE capacity factor {factor} drops tokens (woven: none, or experts / top-k = "
                f"{config.num_moe_experts / config.moe_router_topk:g}, which drops none)")
    if getattr(config, "moe_latent_size", None):
        return "latent MoE"
    etp = getattr(config, "expert_tensor_parallel_size", None)
    if etp not in (None, config.tensor_model_parallel_size):
        return "expert tensor parallelism different from tensor parallelism"
    return None


def check_capacity(layer: MoELayer, token_counts: list[int]) -> None:
    """Raise unless every call of the MoE layer on `token_counts` tokens keeps every token:
    Megatron's capacity (its own get_capacity, as its router and dispatcher compute it) must be
    at least the tokens, and with the padded dispatcher exactly the tokens (a larger one breaks
    Megatron's padded permute, whose router can mark at most every token for an expert). A
    factor of experts / top-k gives exactly the tokens when float arithmetic keeps it exact
    (8 / 2 does; some quotients round up by one slot for some token counts)."""
    config = layer.config
    factor = config.moe_expert_capacity_factor
    if factor is None:
        return
    for tokens in token_counts:
        capacity = get_capacity(tokens * config.moe_router_topk, config.num_moe_experts, factor)
        if capacity < tokens or (padded(layer) and capacity != tokens):
            raise TokenWeaveInputError(
                f"MoE capacity {capacity} (factor {factor}) for {tokens} tokens: the woven "
                f"layer needs {'exactly' if padded(layer) else 'at least'} one slot per token "
                f"and expert; use a capacity factor of experts / top-k that Megatron's "
                f"get_capacity turns into exactly the token count")


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

"""A layer as the woven schedule sees it: a sequence of mixer stages.

Every Megatron layer the woven schedule runs is one or two stages, each an RMSNorm, a mixer and
the row-parallel linear that ends it, whose all-reduce meets the residual add and the next
stage's norm (the fused op):

    GPTModel layer / hybrid '*'   attention        input_layernorm    linear_qkv ... linear_proj
    GPTModel layer / hybrid '-'   mlp              pre_mlp_layernorm  linear_fc1 ... linear_fc2
    hybrid 'E' (and GPT MoE)      moe              pre_mlp_layernorm  the experts' partial sums
    hybrid 'G'                    gdn              input_layernorm    in_proj ... out_proj
    hybrid 'M'                    mamba            norm               mixer.in_proj ... out_proj

A GPTModel layer is attention + mlp (or moe); a hybrid layer is one stage. Token-wise mixers
(mlp, moe) run half by half; the others (attention, Mamba's scan, the gated delta rule) need a
sequence's earlier rows, so their core runs on all rows and only the linears around it are split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.identity_op import IdentityOp

from megatron_tokenweave import moe

# Keyword arguments of the layer's forward each kind of mixer takes.
ATTENTION_KWARGS = (
    "attention_mask",
    "inference_context",
    "rotary_pos_emb",
    "rotary_pos_cos",
    "rotary_pos_sin",
    "rotary_pos_cos_sin",
    "attention_bias",
    "packed_seq_params",
    "sequence_len_offset",
)
MAMBA_KWARGS = ("inference_context", "packed_seq_params")


@dataclass(frozen=True, eq=False)
class MixerStage:
    """One stage of a layer: `norm_name` names the layer's RMSNorm module before the mixer
    (the fused op of the stage before applies it), `column` / `row` the linears that take the
    normed rows and return the partial sums (None for MoE, whose experts compute them)."""

    kind: str  # "attention", "gdn", "mamba", "mlp" or "moe"
    norm_name: str
    mixer: torch.nn.Module
    column: torch.nn.Module | None
    row: torch.nn.Module | None
    kwargs: tuple[str, ...] = ()

    @property
    def tokenwise(self) -> bool:
        """The mixer treats every row on its own: it runs once per half."""
        return self.kind in ("mlp", "moe")

    @property
    def is_moe(self) -> bool:
        return self.kind == "moe"

    def mixer_kwargs(self, layer_kwargs: dict) -> dict:
        """The layer's keyword arguments this stage's mixer takes."""
        kwargs = dict(layer_kwargs)
        if kwargs.get("inference_context") is None and kwargs.get("inference_params") is not None:
            kwargs["inference_context"] = kwargs["inference_params"]
        return {k: kwargs[k] for k in self.kwargs if k in kwargs}


def _linears(module: torch.nn.Module, *pairs: tuple[str, str]) -> tuple[torch.nn.Module | None,
                                                                         torch.nn.Module | None]:
    """The first (column, row) attribute pair `module` has."""
    for column, row in pairs:
        if hasattr(module, column) and hasattr(module, row):
            return getattr(module, column), getattr(module, row)
    return None, None


def layer_stages(layer: torch.nn.Module) -> tuple[MixerStage, ...]:
    """The stages of a Megatron TransformerLayer (any of its hybrid forms) or MambaLayer, in
    order. A stage whose linears are not the two of a known mixer has column/row None."""
    if hasattr(layer, "mixer") and hasattr(layer, "norm"):  # MambaLayer
        column, row = _linears(layer.mixer, ("in_proj", "out_proj"))
        return (MixerStage("mamba", "norm", layer.mixer, column, row, MAMBA_KWARGS),)
    stages = []
    attention = layer.self_attention
    if not isinstance(attention, IdentityOp):
        column, row = _linears(attention, ("linear_qkv", "linear_proj"), ("in_proj", "out_proj"))
        kind = "gdn" if hasattr(attention, "in_proj") and not hasattr(attention, "linear_qkv") \
            else "attention"
        stages.append(MixerStage(kind, "input_layernorm", attention, column, row,
                                 ATTENTION_KWARGS))
    mlp = layer.mlp
    if moe.is_moe(mlp):
        stages.append(MixerStage("moe", "pre_mlp_layernorm", mlp, None, None))
    elif not isinstance(mlp, IdentityOp):
        column, row = _linears(mlp, ("linear_fc1", "linear_fc2"))
        stages.append(MixerStage("mlp", "pre_mlp_layernorm", mlp, column, row))
    return tuple(stages)

"""A causal core attention through torch SDPA (flash attention on Hopper), put into both the
stock and the TokenWeave spec of a benchmark so they compare with the same attention kernel.

Megatron's local spec uses DotProductAttention, which materializes the [b, heads, s, s] scores:
at 2K+ tokens it dominates the layer and hides what the benchmark is about. (The TE spec uses
TE's fused attention; this module is the local-spec stand-in for it.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


class SDPACoreAttention(torch.nn.Module):
    """Causal self-attention core: q [sq, b, np, hn], k/v [sk, b, ng, hn] -> [sq, b, np*hn]."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 **_: Any) -> None:
        super().__init__()
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: plain causal attention only")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        sq, b = out.shape[2], out.shape[0]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def with_sdpa(spec: ModuleSpec | TransformerBlockSubmodules):
    """The same layer, block or hybrid stack spec with SDPACoreAttention as every attention
    layer's core attention."""
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[with_sdpa(s) for s in spec.layer_specs])
    if isinstance(spec.submodules, HybridStackSubmodules):
        return dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, attention_layer=with_sdpa(spec.submodules.attention_layer)))
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, core_attention=SDPACoreAttention),
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
    )

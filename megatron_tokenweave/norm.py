"""Norms of the local-flavour spec: torch's own norms, allowed under sequence parallelism.

Megatron's WrappedTorchNorm refuses `sequence_parallel=True`; the woven layer applies the norm
itself on the fused path, and on the fallback path a plain per-row norm is correct on a
sequence shard too. Parameters are torch's (`weight`, and `bias` for LayerNorm).
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig


class TokenWeaveNorm:
    """Build torch.nn.RMSNorm (or LayerNorm, which the woven layer runs on its fallback path)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object):
        if config.layernorm_zero_centered_gamma:
            raise ValueError("TokenWeave norms do not support layernorm_zero_centered_gamma")
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"TokenWeave supports RMSNorm and LayerNorm, not {config.normalization}"
            )
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def norm_weight_eps(norm: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of an RMSNorm module the fused op can replace, else None."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "eps", None)
    if not isinstance(weight, torch.Tensor) or eps is None:
        return None
    if isinstance(norm, torch.nn.LayerNorm) or getattr(norm, "bias", None) is not None:
        return None
    if getattr(norm, "zero_centered_gamma", False):
        return None
    return weight, float(eps)

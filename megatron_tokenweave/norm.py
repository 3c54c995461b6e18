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


_CAST_ATTR = "_tokenweave_weight_cast"


def norm_weight_eps_in(norm: torch.nn.Module,
                       dtype: torch.dtype) -> tuple[torch.Tensor, float] | None:
    """norm_weight_eps with the weight in the activations' dtype. Megatron builds torch norms in
    the default dtype when a model is not cast as a whole; the cast is then kept on the module
    (made again when the weight changes) so eager forwards do not allocate. A CUDA-graph
    capture records its own cast: its replays then follow later weight updates, and never read
    a kept cast that an eager forward may replace (and free)."""
    found = norm_weight_eps(norm)
    if found is None or found[0].dtype == dtype:
        return found
    weight, eps = found
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        return weight.to(dtype), eps
    # What identifies the weight's values besides the object: its storage (model.to() replaces
    # .data) and its version counter (in-place updates).
    state = (weight.data_ptr(), weight._version, dtype)
    kept = getattr(norm, _CAST_ATTR, None)
    if kept is not None and kept[0] is weight and kept[1] == state:
        return kept[2], eps
    cast = weight.to(dtype)
    setattr(norm, _CAST_ATTR, (weight, state, cast))
    return cast, eps

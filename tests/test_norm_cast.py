"""The fused op's norm weight in the activations' dtype (norm.norm_weight_eps_in): cast once and
kept on the module, so forwards do not allocate; made again when the weight changes."""

from __future__ import annotations

import torch

from megatron_tokenweave.norm import norm_weight_eps_in


class _RMSNorm(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.eps = 1e-5


def test_cast_is_kept_until_the_weight_changes():
    norm = _RMSNorm(16)
    first, eps = norm_weight_eps_in(norm, torch.bfloat16)
    assert eps == 1e-5 and first.dtype == torch.bfloat16
    assert torch.equal(first, norm.weight.detach().to(torch.bfloat16))
    assert norm_weight_eps_in(norm, torch.bfloat16)[0] is first  # no new tensor per forward
    with torch.no_grad():
        norm.weight.mul_(2.0)  # e.g. load_state_dict's in-place copy
    again = norm_weight_eps_in(norm, torch.bfloat16)[0]
    assert again is not first and torch.equal(again, norm.weight.detach().to(torch.bfloat16))
    assert norm_weight_eps_in(norm, torch.float16)[0].dtype == torch.float16
    norm.weight = torch.nn.Parameter(torch.ones(16))  # a new parameter object
    assert torch.equal(norm_weight_eps_in(norm, torch.float16)[0], torch.ones(16).half())
    norm.weight.data = torch.full((16,), 3.0)  # new storage, as model.to() does
    assert torch.equal(norm_weight_eps_in(norm, torch.float16)[0], torch.full((16,), 3.0).half())


def test_same_dtype_is_the_weight_itself():
    norm = _RMSNorm(8)
    assert norm_weight_eps_in(norm, torch.float32)[0] is norm.weight
    assert norm_weight_eps_in(torch.nn.LayerNorm(8), torch.float32) is None

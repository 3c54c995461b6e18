"""The GPU tests' common skip: a CUDA GPU and the built kernel extension, or skip (not fail)."""

from __future__ import annotations

import pytest
import torch


def kernels_or_skip():
    """megatron_tokenweave.kernels with its extension loaded; skips the test without a GPU or
    without the extension."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from megatron_tokenweave import kernels

    try:
        kernels.load_extension()
    except kernels.KernelUnavailableError as exc:
        pytest.skip(f"kernel extension unavailable: {exc}")
    return kernels

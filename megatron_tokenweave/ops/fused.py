"""One entry point for the fused op; the workspace decides which backend runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_tokenweave.ops.collectives import allreduce_add_rmsnorm_collectives
from megatron_tokenweave.ops.reference import fused_allreduce_rmsnorm_reference
from megatron_tokenweave.ops.validate import Comm, Layout, Phase, check_fused_args, check_phase

if TYPE_CHECKING:
    from megatron_tokenweave.workspace import Workspace


def fused_allreduce_rmsnorm(
    workspace: Workspace,
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual_out: torch.Tensor,
    normed_out: torch.Tensor | None,
    layout: Layout,
    ctas: int = 16,
    validate: bool = True,
    comm: Comm = "fused",
    phase: Phase = "whole",
) -> None:
    """y = sum over the TP group of `partial` + `residual`; normed = RMSNorm(y) * weight.

    partial: [C, n, H], C = TP size (sequence-parallel: chunk r is reduced onto rank r) or 1
        (replicated: every rank reduces every row). On the kernel backend it must lie in
        `workspace.partial` (the symmetric buffer peers read from).
    residual / residual_out: [n, H] this rank's rows (residual_out may alias residual).
    weight: [H] norm weight, or None to add only (then normed_out is None).
    normed_out: [C, n, H] with dense rows and any chunk stride: the normed rows of every chunk,
        on every rank. On the kernel backend it must lie in `workspace.normed`.
    ctas: CTAs the kernel may use (ignored by the reference).
    validate: check the arguments in Python (a layer does until one of its forwards passed
        the checks, then builds them the same way every call; the kernel's own C++ checks of
        shapes, dtypes, devices and alignment run on every call; the reference always checks).
    comm: "fused" runs the workspace's backend (the P2P kernel, or the fp32 reference);
        "copy_engine" the same with the kernel's data moved by copy engines (the kernel backend's
        copy-engine path; the reference backend has no such distinction and runs the reference);
        "collectives" runs torch.distributed collectives in the activations' dtype plus a separate
        add and norm (the stock mechanism; reduces in place in `partial`).
    phase: "transfer" then "reduce" split the copy-engine op in two (kernels.fused_allreduce_
        rmsnorm; only where `phases_apply`). Mechanisms without such phases run the whole op at
        "reduce", when its results are due, and nothing at "transfer".
    """
    check_phase(phase, layout, weight)  # on every backend: a wrong phasing fails on CPU too
    if phase == "transfer" and not (comm == "copy_engine" and workspace.backend == "kernel"):
        return
    if comm == "collectives":
        if validate:
            world = dist.get_world_size(workspace.group)
            check_fused_args(partial, residual, weight, residual_out, normed_out, layout, world)
        allreduce_add_rmsnorm_collectives(
            partial, residual, weight, eps, residual_out, normed_out, layout, workspace.group
        )
    elif workspace.backend == "kernel":
        from megatron_tokenweave import kernels

        kernels.fused_allreduce_rmsnorm(
            partial, residual, weight, eps, residual_out, normed_out, layout,
            workspace.symmetric, ctas=ctas, validate=validate,
            mirror=workspace.copy_engine_mirror() if comm == "copy_engine" else None,
            phase=phase if comm == "copy_engine" else "whole",
        )
    else:
        fused_allreduce_rmsnorm_reference(
            partial, residual, weight, eps, residual_out, normed_out, layout, workspace.group
        )

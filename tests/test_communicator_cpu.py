"""The communicator's collective agreement (CPU, 2 gloo ranks): settings that decide the protocol
are the same on every rank or every rank gets a clear error, never a hang; a rank without the
CUDA extension makes every rank take the same fallback; ranks agree on one SM count; a one-rank
group is a correct no-op reduction.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from _dist import run_ranks

CPU = torch.device("cpu")
H = 16


def _create_with_env(rank: int, world: int, name: str, values: tuple[str | None, ...]) -> str:
    """Set `name` to values[rank] (None: unset) in this rank, create a communicator; the error
    it raised, or "created"."""
    import torch.distributed as dist

    from megatron_tokenweave.communicator import Communicator

    if values[rank] is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = values[rank]
    try:
        Communicator(dist.group.WORLD, 8, H, torch.float32, CPU, "auto")
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return "created"


@pytest.mark.parametrize(("name", "values"), [
    ("TOKENWEAVE_NO_BULK", ("0", "1")),
    ("TOKENWEAVE_NO_ONESHOT", (None, "1")),
    ("TOKENWEAVE_KERNEL_TIMEOUT_S", ("10", "0.5")),
    ("TOKENWEAVE_SPLIT_THRESHOLD", ("1024", None)),
])
def test_a_variable_set_differently_on_one_rank_is_an_error_on_every_rank(name, values):
    t0 = time.monotonic()
    results = run_ranks(_create_with_env, name, values)
    assert time.monotonic() - t0 < 60  # both ranks answered: nobody waited for a peer
    for rank, result in enumerate(results):
        assert result.startswith("TokenWeaveInputError"), (rank, result)
        assert f"differ in {name}" in result and "same settings" in result, (rank, result)


def test_the_same_values_on_every_rank_agree():
    assert run_ranks(_create_with_env, "TOKENWEAVE_NO_BULK", ("1", "1")) == ["created"] * 2


def _tables_differ(rank: int, world: int, folder: str) -> str:
    import torch.distributed as dist

    from megatron_tokenweave import policy
    from megatron_tokenweave.communicator import Communicator

    cache = os.path.join(folder, f"rank{rank}")
    os.makedirs(os.path.join(cache, "tuning"), exist_ok=True)
    if rank == 1:  # a table only this rank's cache holds
        with open(os.path.join(cache, "tuning", "extra.json"), "w") as f:
            f.write("{}")
    policy.CACHE_DIR = __import__("pathlib").Path(cache)
    try:
        Communicator(dist.group.WORLD, 8, H, torch.float32, CPU, "auto")
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return "created"


def test_cached_tuning_tables_that_differ_between_ranks_are_an_error(tmp_path):
    for result in run_ranks(_tables_differ, str(tmp_path)):
        assert "differ in tuning tables in the cache" in result, result


def _without_extension_on_rank_1(rank: int, world: int, requested: str) -> str:
    """A rank whose CUDA extension cannot load (faked: a CUDA device object, and
    kernels.is_available and the SM count answered per rank; nothing touches CUDA before the
    agreement)."""
    import torch.distributed as dist

    from megatron_tokenweave import communicator, kernels
    from megatron_tokenweave.communicator import agree

    kernels.is_available = lambda: rank == 0
    communicator._sm_count = lambda device: 132
    try:
        return agree(dist.group.WORLD, torch.device("cuda", 0), requested, H).backend
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def test_a_rank_without_the_extension_gives_every_rank_the_same_fallback():
    """auto: every rank falls back to NCCL collectives in the model's dtype (not the fp32
    reference); kernel: every rank raises, naming the cause."""
    assert run_ranks(_without_extension_on_rank_1, "auto") == ["collectives", "collectives"]
    results = run_ranks(_without_extension_on_rank_1, "kernel")
    assert "could not be loaded on another rank" in results[0], results
    assert "could not be loaded on this rank" in results[1], results
    assert all(r.startswith("RuntimeError: TokenWeave backend 'kernel'") for r in results)


def _sm_counts(rank: int, world: int, counts: tuple[int, ...]) -> tuple[str, int]:
    """Agree with this rank's GPU faked to have counts[rank] SMs (the extension faked loaded,
    peer access faked granted)."""
    import torch.distributed as dist

    from megatron_tokenweave import communicator, kernels

    kernels.is_available = lambda: True
    communicator._sm_count = lambda device: counts[rank]
    communicator._peer_reachable = lambda group, device: (True, "")
    a = communicator.agree(dist.group.WORLD, torch.device("cuda", rank), "auto", H)
    return a.backend, a.sms


def test_ranks_whose_gpus_differ_in_sm_count_agree_on_the_smallest():
    """The communicating GEMM's tile shapes and release follow from its CTA budget; ranks that
    counted different SMs would pick different protocols and time out waiting for each other."""
    assert run_ranks(_sm_counts, (132, 114)) == [("kernel", 114)] * 2
    assert run_ranks(_sm_counts, (78, 78)) == [("kernel", 78)] * 2


@pytest.mark.parametrize("comm", ["fused", "collectives"])
@pytest.mark.parametrize("sp", [False, True])
def test_one_rank_group_is_a_correct_noop_reduction(single_rank_group, comm, sp):
    """TP group of one rank, both layouts: y = partial + residual, normed = RMSNorm(y) * w."""
    from megatron_tokenweave.communicator import Communicator
    from megatron_tokenweave.ops import Layout
    from megatron_tokenweave.ops.reference import rms_norm_fp32

    gen = torch.Generator().manual_seed(3)
    n = 5
    c = Communicator(single_rank_group, 8, H, torch.float32, CPU, "auto")
    assert c.backend == "reference"
    partial = c.partial[:n].view(1, n, H)
    partial.copy_(torch.randn(1, n, H, generator=gen))
    want_partial = partial[0].clone()
    residual = torch.randn(n, H, generator=gen)
    weight = 1 + 0.1 * torch.randn(H, generator=gen)
    out = torch.full_like(residual, float("nan"))
    normed = c.normed[:n].view(1, n, H).fill_(float("nan"))
    layout = Layout.SEQUENCE_PARALLEL if sp else Layout.REPLICATED
    c.allreduce_rmsnorm(partial, residual, weight, 1e-5, out, normed, layout, comm=comm)
    y = want_partial + residual
    torch.testing.assert_close(out, y)
    torch.testing.assert_close(normed[0], rms_norm_fp32(y, weight, 1e-5))


def _failure_on_rank_1(rank: int, world: int) -> str:
    """Two ranks whose communicators hold error words like a GPU's signal pad: only rank 1's
    kernel recorded a timeout. A model watched by the serving hook runs a forward on both."""
    import torch.distributed as dist

    from megatron_tokenweave import communicator
    from megatron_tokenweave.kernels.symmetric import SymmetricBuffer
    from megatron_tokenweave.serving.engines import watch_failures

    class Pad:  # SymmetricBuffer's error words and their message, on the CPU
        rank, timeout_s = dist.get_rank(), 10.0
        describe_error = SymmetricBuffer.describe_error

        def error_words(self) -> torch.Tensor:
            return torch.tensor([1, 0, 7, 3] if rank == 1 else [0, 0, 0, 0], dtype=torch.int32)

    comm = object.__new__(communicator.Communicator)
    comm.group, comm.device, comm.symmetric, comm.kernel = dist.group.WORLD, CPU, Pad(), object()
    communicator._communicators[("test",)] = comm
    model = torch.nn.Linear(4, 4)
    watch_failures(model)
    try:
        model(torch.randn(2, 4))
    except communicator.KernelFailure as exc:
        return str(exc)
    return "no error"


def test_a_kernel_failure_on_one_rank_is_raised_on_every_rank():
    """The serving hook's check is collective: rank 1's kernel timed out, rank 0's did not; both
    raise KernelFailure after the same forward (no rank left inside a later collective), rank 0
    naming rank 1."""
    results = run_ranks(_failure_on_rank_1)
    assert "peer rank 0 never arrived at the START barrier (CTA 7" in results[1], results
    assert "kernel on rank 1 of the TP group gave up" in results[0], results


def test_the_serving_hook_costs_nothing_without_kernels(monkeypatch):
    """A model without TokenWeave kernels (a stock model, or the CPU reference backend): the
    hook neither synchronizes nor runs a collective."""
    from megatron_tokenweave.serving import engines

    monkeypatch.setattr(engines, "raise_if_any_failed",
                        lambda: pytest.fail("checked without kernels"))
    watch_failures = engines.watch_failures
    model = torch.nn.Linear(4, 4)
    watch_failures(model)
    watch_failures(model)  # once per model
    assert len(model._forward_hooks) == 1
    model(torch.randn(2, 4))


def _one_rank_fails_to_allocate(rank: int, world: int) -> str:
    import torch.distributed as dist

    from megatron_tokenweave.kernels.symmetric import SymmetricBuffer

    buf = object.__new__(SymmetricBuffer)
    buf.group, buf.rank, buf.world = dist.group.WORLD, rank, world
    released: list[bool] = []
    buf._release = lambda: released.append(True)
    mine = "OutOfMemoryError: CUDA out of memory" if rank == 1 else b"ipc-handle"
    try:
        buf._everyone(mine, "allocating")
    except RuntimeError as exc:
        return f"{exc} | released={released}"
    return "no error"


def test_a_rank_that_cannot_allocate_the_buffer_fails_every_rank():
    """The symmetric buffer exchanges each local step's outcome before the next collective: the
    rank that ran out of memory and the one that did not both raise, naming the failed rank, and
    both release what they hold (no rank left waiting for a handle)."""
    for result in run_ranks(_one_rank_fails_to_allocate):
        assert "allocating failed on rank(s) 1: OutOfMemoryError" in result, result
        assert result.endswith("released=[True]"), result

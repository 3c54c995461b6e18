"""CPU tests of the multimem backend's refusals (kernels.multicast, kernels.policy).

NVLink multicast is never executed here: every test either stops at a refusal or replaces torch's
symmetric-memory entry points with traps that fail the test if anything reaches them. What the
multimem buffer does on hardware (allocation, rendezvous, the multimem kernel) is untested in
this project.
"""

from __future__ import annotations

import dataclasses
import os
import re
from types import SimpleNamespace

import pytest
import torch

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.kernels import multicast, symmetric
from megatron_tokenweave.kernels.policy import (
    MULTIMEM,
    OPT_IN_ENV,
    REFUSED_KILL_SWITCH,
    REFUSED_MULTI_NODE,
    REFUSED_NO_MULTICAST,
    REFUSED_NO_SYMM_MEM,
    REFUSED_NOT_OPTED_IN,
    REFUSED_NOT_REQUESTED,
    REFUSED_OLD_GPU,
    MulticastFacts,
    multimem_backend_refusal,
)
from megatron_tokenweave.launch import NO_MULTICAST_ENV
from megatron_tokenweave.ops.validate import TokenWeaveInputError

OPTED_IN = {OPT_IN_ENV: "1"}
GOOD = MulticastFacts("cuda:0", None, True, 1, (9, 0))
KILL = list(NO_MULTICAST_ENV.items())


def _never():
    raise AssertionError("the device was probed although the environment refuses")


# -- the pure refusal, condition by condition ---------------------------------------------------
def test_every_condition_holds_means_no_refusal():
    assert multimem_backend_refusal(MULTIMEM, OPTED_IN, lambda: GOOD) is None
    newer = dataclasses.replace(GOOD, capability=(10, 0))
    assert multimem_backend_refusal(MULTIMEM, OPTED_IN, lambda: newer) is None


@pytest.mark.parametrize("requested", ["auto", "kernel", "reference", "p2p", "MULTIMEM"])
def test_not_requested(requested):
    r = multimem_backend_refusal(requested, OPTED_IN, _never)
    assert r.code == REFUSED_NOT_REQUESTED and "not requested" in r.reason


@pytest.mark.parametrize("value", [None, "0", "", "no", "2"])
def test_not_opted_in(value):
    env = {} if value is None else {OPT_IN_ENV: value}
    r = multimem_backend_refusal(MULTIMEM, env, _never)
    assert r.code == REFUSED_NOT_OPTED_IN and OPT_IN_ENV in r.reason


@pytest.mark.parametrize("name,value", KILL)
def test_each_kill_switch(name, value):
    r = multimem_backend_refusal(MULTIMEM, {**OPTED_IN, name: value}, _never)
    assert r.code == REFUSED_KILL_SWITCH and f"{name}=" in r.reason


@pytest.mark.parametrize("facts,code,words", [
    (dataclasses.replace(GOOD, symm_mem_error="CUDA is not available"), REFUSED_NO_SYMM_MEM,
     "torch symmetric memory is unavailable on cuda:0: CUDA is not available"),
    (dataclasses.replace(GOOD, multicast=False), REFUSED_NO_MULTICAST,
     "torch reports no multicast support for cuda:0"),
    (dataclasses.replace(GOOD, nodes=2), REFUSED_MULTI_NODE, "spans 2 nodes"),
    (dataclasses.replace(GOOD, capability=(8, 0)), REFUSED_OLD_GPU,
     "cuda:0 is sm_80; multimem needs sm_90"),
])
def test_each_device_condition(facts, code, words):
    r = multimem_backend_refusal(MULTIMEM, OPTED_IN, lambda: facts)
    assert r.code == code and words in r.reason


def test_the_first_failing_condition_is_named():
    """Conditions are checked in order: with everything wrong, the earliest is reported."""
    bad = MulticastFacts("cuda:0", "no symm mem", False, 3, (7, 0))
    assert multimem_backend_refusal("auto", {}, lambda: bad).code == REFUSED_NOT_REQUESTED
    assert multimem_backend_refusal(MULTIMEM, dict(KILL), lambda: bad).code == REFUSED_NOT_OPTED_IN
    env = {**OPTED_IN, **dict(KILL)}
    assert multimem_backend_refusal(MULTIMEM, env, lambda: bad).code == REFUSED_KILL_SWITCH
    assert multimem_backend_refusal(MULTIMEM, OPTED_IN, lambda: bad).code == REFUSED_NO_SYMM_MEM
    no_mc = dataclasses.replace(bad, symm_mem_error=None)
    assert multimem_backend_refusal(MULTIMEM, OPTED_IN, lambda: no_mc).code == REFUSED_NO_MULTICAST
    nodes = dataclasses.replace(no_mc, multicast=True)
    assert multimem_backend_refusal(MULTIMEM, OPTED_IN, lambda: nodes).code == REFUSED_MULTI_NODE


def test_this_machines_environment_refuses_without_probing():
    """Our machines set the kill switches (launch.NO_MULTICAST_ENV): even with both opt-ins the
    refusal comes from the environment, before any device query."""
    env = {**NO_MULTICAST_ENV, **OPTED_IN}
    r = multimem_backend_refusal(MULTIMEM, env, _never)
    assert r.code == REFUSED_KILL_SWITCH


# -- the device probe (torch's answers monkeypatched) ------------------------------------------
class _FakeSymm:
    """Stands in for torch's _SymmetricMemory: records has_multicast_support's queries."""

    def __init__(self, multicast: bool):
        self.multicast, self.queries = multicast, []

    def has_multicast_support(self, device_type, index):
        self.queries.append((device_type, index))
        return self.multicast


def _trap(*args, **kwargs):
    raise AssertionError("torch symmetric memory was asked to allocate or rendezvous")


def _fake_api(multicast: bool):
    symm = _FakeSymm(multicast)
    module = SimpleNamespace(empty=_trap, rendezvous=_trap)
    return symm, lambda: (module, symm, SimpleNamespace(CUDA="CUDA"))


@pytest.fixture
def cuda_here(monkeypatch):
    """Pretend CUDA is available, as an sm_90 device (each test overrides what it checks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))


@pytest.fixture
def trapped(monkeypatch):
    """Fail the test if anything reaches torch's symmetric-memory allocation or rendezvous, or
    loads the extension (the step right before allocating)."""
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._distributed_c10d import _SymmetricMemory

    monkeypatch.setattr(symm_mem, "empty", _trap)
    monkeypatch.setattr(symm_mem, "rendezvous", _trap)
    monkeypatch.setattr(_SymmetricMemory, "empty_strided_p2p", staticmethod(_trap))
    monkeypatch.setattr(_SymmetricMemory, "rendezvous", staticmethod(_trap))
    monkeypatch.setattr(symmetric, "load_extension", _trap)


def test_probe_cpu_device(trapped):
    facts = multicast.probe(torch.device("cpu"), 1)
    assert "not a CUDA device" in facts.symm_mem_error and not facts.multicast


def test_probe_without_cuda(monkeypatch, trapped):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    facts = multicast.probe("cuda:0", 1)
    assert facts.symm_mem_error == "CUDA is not available"
    r = multimem_backend_refusal(MULTIMEM, OPTED_IN, lambda: facts)
    assert r.code == REFUSED_NO_SYMM_MEM


def test_probe_torch_without_symmetric_memory(monkeypatch, cuda_here, trapped):
    def unavailable():
        raise ImportError("no module named torch.distributed._symmetric_memory")

    monkeypatch.setattr(multicast, "_symm_mem_api", unavailable)
    facts = multicast.probe("cuda:1", 1)
    assert "ImportError" in facts.symm_mem_error
    assert multimem_backend_refusal(MULTIMEM, OPTED_IN, lambda: facts).code == REFUSED_NO_SYMM_MEM


def test_the_real_torch_api_is_what_the_probe_expects():
    """The installed torch has the entry points the buffer uses (import only, nothing called)."""
    symm_mem, symm, device_type = multicast._symm_mem_api()
    for name in ("empty", "rendezvous"):
        assert callable(getattr(symm_mem, name))
    for name in ("has_multicast_support", "buffer_ptrs", "multicast_ptr"):
        assert hasattr(symm, name)
    assert device_type.CUDA is not None


@pytest.mark.parametrize("multicast_ok,capability,nodes,code", [
    (False, (9, 0), 1, REFUSED_NO_MULTICAST),
    (True, (9, 0), 2, REFUSED_MULTI_NODE),
    (True, (8, 0), 1, REFUSED_OLD_GPU),
    (True, (8, 9), 1, REFUSED_OLD_GPU),
    (True, (9, 0), 1, None),
])
def test_probe_reports_torch_and_the_device(monkeypatch, cuda_here, trapped, multicast_ok,
                                            capability, nodes, code):
    symm, api = _fake_api(multicast_ok)
    monkeypatch.setattr(multicast, "_symm_mem_api", api)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    facts = multicast.probe(torch.device("cuda", 3), nodes)
    assert symm.queries == [("CUDA", 3)]
    assert facts == MulticastFacts("cuda:3", None, multicast_ok, nodes, capability)
    r = multimem_backend_refusal(MULTIMEM, OPTED_IN, lambda: facts)
    assert (r and r.code) == code


# -- the buffer: refused on every rank before anything is allocated ------------------------------
def test_config_accepts_multimem(monkeypatch):
    assert TokenWeaveConfig(backend="multimem").backend == "multimem"
    monkeypatch.setenv("TOKENWEAVE_BACKEND", "multimem")
    assert TokenWeaveConfig.from_env().backend == "multimem"
    with pytest.raises(ValueError, match="backend"):
        TokenWeaveConfig(backend="nvls")


@pytest.mark.parametrize("env,code", [
    ({}, REFUSED_NOT_OPTED_IN),
    (dict(NO_MULTICAST_ENV), REFUSED_NOT_OPTED_IN),
    ({**NO_MULTICAST_ENV, **OPTED_IN}, REFUSED_KILL_SWITCH),
    *[({name: value, **OPTED_IN}, REFUSED_KILL_SWITCH) for name, value in KILL],
    (OPTED_IN, REFUSED_NO_SYMM_MEM),  # no CUDA (as on this machine)
])
def test_buffer_refused_before_any_allocation(single_rank_group, monkeypatch, trapped, env,
                                              code):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refusal = multicast.agreed_refusal(single_rank_group, "cuda:0", MULTIMEM, env)
    assert refusal.code == code and refusal.reason.endswith("(rank 0)")
    _set_environment(monkeypatch, env)
    with pytest.raises(TokenWeaveInputError,
                       match=rf"multimem buffer refused: {re.escape(refusal.reason)}$"):
        multicast.MulticastBuffer(single_rank_group, 1 << 20, "cuda:0")


def _set_environment(monkeypatch, env):
    """Exactly `env` of the variables the refusal reads (the buffer reads os.environ)."""
    for name in (OPT_IN_ENV, *NO_MULTICAST_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("multicast_ok,capability,code", [
    (False, (9, 0), REFUSED_NO_MULTICAST),
    (True, (8, 6), REFUSED_OLD_GPU),
])
def test_buffer_refused_by_the_device(single_rank_group, monkeypatch, cuda_here, trapped,
                                      multicast_ok, capability, code):
    monkeypatch.setattr(multicast, "_symm_mem_api", _fake_api(multicast_ok)[1])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    assert multicast.agreed_refusal(single_rank_group, "cuda:0", MULTIMEM, OPTED_IN).code == code
    _set_environment(monkeypatch, OPTED_IN)
    with pytest.raises(TokenWeaveInputError, match="multimem buffer refused"):
        multicast.MulticastBuffer(single_rank_group, 1 << 20, "cuda:0")


def test_allocation_comes_only_after_every_condition(single_rank_group, monkeypatch, cuda_here):
    """With every condition met (faked), the buffer goes on to load the extension and only then
    allocates: here the extension step stops it, and allocation is never reached."""
    steps = []
    monkeypatch.setattr(multicast, "_symm_mem_api", _fake_api(True)[1])

    def stop():
        steps.append("load_extension")
        raise RuntimeError("stop before allocating")

    monkeypatch.setattr(symmetric, "load_extension", stop)
    assert multicast.agreed_refusal(single_rank_group, "cuda:0", MULTIMEM, OPTED_IN) is None
    _set_environment(monkeypatch, OPTED_IN)
    with pytest.raises(RuntimeError, match="stop before allocating"):
        multicast.MulticastBuffer(single_rank_group, 1 << 20, "cuda:0")
    assert steps == ["load_extension"]


# -- every rank gets the same answer -------------------------------------------------------------
def _two_rank_refusals(rank, world):
    """Rank 0 opted in on a CPU (refusal: no symmetric memory); rank 1 also has a kill switch.
    Both must agree on rank 1's earlier condition and raise the same error."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.empty = symm_mem.rendezvous = _trap
    symmetric.load_extension = _trap
    for name in NO_MULTICAST_ENV:  # the launcher set this machine's kill switches
        os.environ.pop(name, None)
    os.environ[OPT_IN_ENV] = "1"
    if rank == 1:
        os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    refusal = multicast.agreed_refusal(dist.group.WORLD, "cuda:0", MULTIMEM)
    try:
        multicast.MulticastBuffer(dist.group.WORLD, 1 << 20, "cuda:0")
    except TokenWeaveInputError as exc:
        return tuple(refusal), str(exc)
    return tuple(refusal), None


def test_ranks_agree_on_one_refusal():
    from _dist import run_ranks

    results = run_ranks(_two_rank_refusals)
    assert results[0] == results[1]
    (code, reason), message = results[0]
    assert code == REFUSED_KILL_SWITCH
    assert reason == "multicast disabled by NVSHMEM_DISABLE_NVLS=1 (rank 1)"
    assert message == f"multimem buffer refused: {reason}"


# -- the mapping torch returned --------------------------------------------------------------------
def test_mapping_problem():
    mc = 0x7F0000000000
    assert multicast.mapping_problem([(0, 0, mc), (0, 0, mc + (1 << 30))]) is None
    assert "no multicast mapping on rank 1" in multicast.mapping_problem([(0, 0, mc), (0, 0, 0)])
    assert "rank 0's buffer lies 512 bytes" in multicast.mapping_problem([(512, 512, mc)] * 2)
    assert "rank 1's buffer lies 256 bytes" in multicast.mapping_problem(
        [(0, 0, mc), (0, 256, mc)])

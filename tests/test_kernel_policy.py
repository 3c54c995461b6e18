"""CPU tests of the host-side kernel policy: multimem is never chosen unless everything allows it,
the kernel package imports without a GPU, the Python mirrors of the CUDA constants and enums,
the error words' messages, and the call tags."""

from __future__ import annotations

import itertools
import os
import pathlib
import re

import pytest
import torch

from megatron_tokenweave.kernels.policy import (
    MULTIMEM,
    OPT_IN_ENV,
    P2P,
    multicast_disabled_reason,
    select_backend,
)
from megatron_tokenweave.kernels.symmetric import ERROR_WORDS, SymmetricBuffer
from megatron_tokenweave.ops.validate import TokenWeaveInputError

KILL = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
MC = 0x7F0000000000


def test_multimem_only_when_everything_allows():
    assert select_backend("auto", {OPT_IN_ENV: "1"}, True, MC) == MULTIMEM
    assert select_backend("multimem", {OPT_IN_ENV: "1"}, True, MC) == MULTIMEM


@pytest.mark.parametrize("opt_in", [None, "0", "", "no"])
def test_no_opt_in_means_p2p(opt_in):
    env = {} if opt_in is None else {OPT_IN_ENV: opt_in}
    assert select_backend("auto", env, True, MC) == P2P
    with pytest.raises(TokenWeaveInputError, match="not opted in"):
        select_backend("multimem", env, True, MC)


@pytest.mark.parametrize("name,value", list(KILL.items()))
def test_each_kill_switch_forbids_multimem(name, value):
    env = {OPT_IN_ENV: "1", name: value}
    assert multicast_disabled_reason(env) is not None
    assert select_backend("auto", env, True, MC) == P2P
    with pytest.raises(TokenWeaveInputError, match="multicast disabled"):
        select_backend("multimem", env, True, MC)


def test_no_device_support_or_no_address_means_p2p():
    env = {OPT_IN_ENV: "1"}
    assert select_backend("auto", env, False, MC) == P2P
    assert select_backend("auto", env, True, None) == P2P
    assert select_backend("auto", env, True, 0) == P2P
    with pytest.raises(TokenWeaveInputError, match="multicast support"):
        select_backend("multimem", env, False, MC)


def test_exhaustive_never_multimem_unless_all_conditions():
    opt_ins = [None, "1", "0"]
    kills = [None, *KILL.items()]
    for opt, kill, dev_ok, mc in itertools.product(opt_ins, kills, [False, True], [None, MC]):
        env = {}
        if opt is not None:
            env[OPT_IN_ENV] = opt
        if kill is not None:
            env[kill[0]] = kill[1]
        got = select_backend("auto", env, dev_ok, mc)
        allowed = opt == "1" and kill is None and dev_ok and mc is not None
        assert got == (MULTIMEM if allowed else P2P), (env, dev_ok, mc)
        assert select_backend("p2p", env, dev_ok, mc) == P2P


def test_this_machines_env_forbids_multimem(monkeypatch):
    for k, v in KILL.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(OPT_IN_ENV, "1")
    import os

    assert select_backend("auto", os.environ, True, MC) == P2P


def test_bad_backend_name():
    with pytest.raises(TokenWeaveInputError):
        select_backend("nvls", {}, True, MC)


def test_kernels_import_without_gpu():
    """Without CUDA the kernels package imports and says it is unavailable (no build, no raise)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CPU-only property (this machine has CUDA)")
    from megatron_tokenweave import kernels

    assert kernels.is_available() is False


class _StubBuffer:
    """Stands in for SymmetricBuffer: device error words are a CPU tensor here."""

    rank, timeout_s = 0, 10.0

    def __init__(self):
        self.words = torch.zeros(ERROR_WORDS, dtype=torch.int32)

    def error_words(self):
        return self.words

    describe_error = SymmetricBuffer.describe_error


def test_kernel_timeout_raises_from_the_copied_error_words():
    """raise_if_failed reads the words the last record_errors() copied (no sync): nothing
    recorded, no error; a START-barrier timeout raises naming the peer, the slot and the
    timeout."""
    from megatron_tokenweave.communicator import Communicator

    comm = object.__new__(Communicator)
    comm.symmetric, comm._errors = _StubBuffer(), torch.zeros(ERROR_WORDS, dtype=torch.int32)
    comm.raise_if_failed()  # nothing recorded yet
    comm._errors.copy_(torch.tensor([1, 1, 3, 42, 0, 0, 0, 0]))  # copied after a timeout
    with pytest.raises(RuntimeError, match=r"peer rank 1 never arrived at the START barrier "
                       r"\(CTA 3, epoch/round 42, timeout 10.0 s\)"):
        comm.raise_if_failed()


def test_oneshot_threshold_mirrors_the_cuda_constant():
    """kernels.ONESHOT_ROUND_BYTES is the receive-buffer size the CUDA op checks
    (kOneShotRoundBytes in signal.cuh): the benchmark and docs rely on the Python mirror."""
    import pathlib
    import re

    from megatron_tokenweave.kernels import ONESHOT_ROUND_BYTES

    header = pathlib.Path(__file__).parents[1] / "csrc/include/tokenweave/signal.cuh"
    m = re.search(r"kOneShotRoundBytes\s*=\s*int64_t\{(\d+)\}\s*<<\s*(\d+);", header.read_text())
    assert m is not None, "kOneShotRoundBytes not found in signal.cuh"
    assert ONESHOT_ROUND_BYTES == int(m.group(1)) << int(m.group(2))


def test_kernel_limits_mirror_the_cuda_constants():
    """ops.validate's MAX_CTAS / MAX_RANKS / MAX_HIDDEN (config, table and backend checks) are
    common.cuh's kMaxCtas, kMaxRanks and kMaxThreads * kMaxVecsPerThread * kVecElems."""
    import pathlib
    import re

    from megatron_tokenweave.ops.validate import MAX_CTAS, MAX_HIDDEN, MAX_RANKS

    text = (pathlib.Path(__file__).parents[1] / "csrc/include/tokenweave/common.cuh").read_text()
    value = {name: int(v) for name, v in re.findall(r"constexpr int (k\w+) = (\d+);", text)}
    assert MAX_CTAS == value["kMaxCtas"] and MAX_RANKS == value["kMaxRanks"]
    assert MAX_HIDDEN == value["kMaxThreads"] * value["kMaxVecsPerThread"] * value["kVecElems"]


def test_twoshot_threshold_mirrors_the_cuda_constant():
    """kernels.TWOSHOT_MIN_WORLD is kTwoShotMinWorld of twoshot.cuh (the TP size from which
    replicated calls too large for the one-shot path take the two-shot path)."""
    import pathlib
    import re

    from megatron_tokenweave.kernels import TWOSHOT_MIN_WORLD

    header = pathlib.Path(__file__).parents[1] / "csrc/include/tokenweave/twoshot.cuh"
    m = re.search(r"constexpr int kTwoShotMinWorld = (\d+);", header.read_text())
    assert m is not None and TWOSHOT_MIN_WORLD == int(m.group(1))


def test_twoshot_applies_to_large_replicated_calls_from_tp4():
    from megatron_tokenweave.kernels import twoshot_applies
    from megatron_tokenweave.ops.validate import Layout

    assert not twoshot_applies(Layout.REPLICATED, 2, 4096, 8192, 2)  # TP=2 pulls every row
    assert twoshot_applies(Layout.REPLICATED, 4, 4096, 8192, 2)
    assert twoshot_applies(Layout.REPLICATED, 8, 129, 8192, 2)  # past the one-shot buffer
    assert not twoshot_applies(Layout.REPLICATED, 8, 64, 8192, 2)  # one-shot: 8 MiB exactly
    assert not twoshot_applies(Layout.SEQUENCE_PARALLEL, 8, 4096, 8192, 2)


def test_oneshot_applies_to_small_replicated_calls_only():
    from megatron_tokenweave.kernels import oneshot_applies
    from megatron_tokenweave.ops.validate import Layout

    assert oneshot_applies(Layout.REPLICATED, 2, 256, 8192, 2)      # 8 MiB exactly
    assert not oneshot_applies(Layout.REPLICATED, 2, 257, 8192, 2)
    assert oneshot_applies(Layout.REPLICATED, 2, 512, 4096, 2)
    assert not oneshot_applies(Layout.REPLICATED, 8, 128, 8192, 2)  # 16 MiB at TP=8
    assert not oneshot_applies(Layout.SEQUENCE_PARALLEL, 2, 1, 8192, 2)


def test_error_names_the_copy_engine_barrier_slots():
    """Timeouts in the copy-engine op's barrier kernels (slots kCopyEngineSlot and
    kCopyEngineMidSlot after the kMaxCtas CTA slots of signal.cuh) are named as such."""
    import pathlib
    import re

    header = pathlib.Path(__file__).parents[1] / "csrc/include/tokenweave"
    max_ctas = int(re.search(r"kMaxCtas\s*=\s*(\d+);",
                             (header / "common.cuh").read_text()).group(1))
    signal = (header / "signal.cuh").read_text()
    assert "kCopyEngineSlot = kMaxCtas;" in signal
    assert "kCopyEngineMidSlot = kMaxCtas + 1;" in signal
    stub = _StubBuffer()
    assert "(CTA 5," in stub.describe_error(1, 1, 5, 7)
    assert "(copy-engine op, START/END," in stub.describe_error(1, 1, max_ctas, 7)
    assert "(copy-engine op, MID," in stub.describe_error(1, 1, max_ctas + 1, 7)


def test_a_call_mismatch_names_the_peer_and_both_calls():
    """kCallMismatch (a peer published another call's tag or epoch): the message names the peer,
    the slot, both epochs and both tags, and says no rows were combined; raise_if_failed
    raises it from the copied words."""
    from megatron_tokenweave.communicator import Communicator, KernelFailure
    from megatron_tokenweave.kernels.symmetric import CALL_MISMATCH

    header = pathlib.Path(__file__).parents[1] / "csrc/include/tokenweave/signal.cuh"
    text = header.read_text()
    assert re.search(rf"kCallMismatch = {CALL_MISMATCH},", text)
    assert re.search(rf"kErrorWords = {ERROR_WORDS},", text)
    comm = object.__new__(Communicator)
    comm.symmetric, comm._errors = _StubBuffer(), torch.zeros(ERROR_WORDS, dtype=torch.int32)
    comm._errors.copy_(torch.tensor([CALL_MISMATCH, 3, 9, 41, 42, 0x1234, 0x77, 0]))
    with pytest.raises(KernelFailure, match=r"peer rank 3 is on another call \(CTA or row block "
                       r"9: its epoch/round 42, tag 0x77; this rank's 41, tag 0x1234\).*no rows "
                       r"of the two calls were combined"):
        comm.raise_if_failed()


def test_call_tags_name_the_call_and_its_shape():
    """call_tag: nonzero and 31-bit (the communicating GEMM takes it as an int32 argument), the
    same for the same call and shape in every process (the ranks compute it apart), different
    for another call number or shape."""
    import subprocess
    import sys

    from megatron_tokenweave.kernels import call_tag

    tags = {call_tag(call, *shape) for call in range(64) for shape in ((0, 16, 1, 8, 4096, 1),
                                                                        (0, 16, 1, 9, 4096, 1))}
    assert len(tags) == 128 and all(0 < t <= 0x7FFFFFFF for t in tags)
    code = "from megatron_tokenweave.kernels import call_tag; print(call_tag(7, 0, 16, 1, 9, 64))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": "123"})
    assert int(other.stdout.split()[-1]) == call_tag(7, 0, 16, 1, 9, 64)


def test_the_inbox_tags_follow_the_control_words():
    """The GEMM stores the call's tag at tag[set][rank] of each owner's inbox, right after
    epoch[2] and done[2] (kernels/inbox.py's tags_off), where the consumer reads it
    (csrc/ops.cu kInboxTagWords), eight words a set (owner_protocol.TAG_SLOTS = kMaxRanks)."""
    from megatron_tokenweave.kernels import owner_protocol
    from megatron_tokenweave.kernels.inbox import GemmInbox

    inbox = GemmInbox(2, 0, 4096, 1024, torch.bfloat16,
                      lambda n: ([0, 0], [torch.zeros(n, dtype=torch.uint8)] * 2), lambda: None)
    assert inbox.tags_off == inbox.control_off + 4 * 4
    assert inbox.slots_off >= inbox.tags_off + 4 * 2 * 8 and inbox.control.numel() == 4 + 16
    ops = (pathlib.Path(__file__).parents[1] / "csrc/ops.cu").read_text()
    assert "constexpr int64_t kInboxTagWords = 4;" in ops
    assert owner_protocol.TAG_SLOTS.value == 8


def test_the_op_path_codes_mirror_the_cuda_enum():
    """The op's `path` codes (the SM kernels, the copy-engine op whole or in its two phases) are
    csrc/ops.cu's Path enum."""
    from megatron_tokenweave.kernels import comm

    text = (pathlib.Path(__file__).parents[1] / "csrc/ops.cu").read_text()
    enum = dict(re.findall(r"(kPath\w+) = (\d+),", text))
    assert comm._PATH_CODES == {("sm", "whole"): int(enum["kPathSm"]),
                                ("copy_engine", "whole"): int(enum["kPathCopyEngine"]),
                                ("copy_engine", "transfer"): int(enum["kPathCopyEngineTransfer"]),
                                ("copy_engine", "reduce"): int(enum["kPathCopyEngineReduce"])}


def test_segment_geometry_is_the_consumers_list():
    """Segments.geometry: the six numbers csrc/ops.cu's SegmentGeometry reads, in its order;
    where the consumer publishes, the segment is one block of one tile (its one flag per
    source)."""
    from megatron_tokenweave.ops.segments import segments
    from megatron_tokenweave.ops.validate import Layout

    for release in ("gemm", "consumer"):
        seg = segments(Layout.REPLICATED, 2, 777, hidden=8192, k=4096, ctas=132, set_index=1,
                       first_set_rows=777, release=release)
        blocks = ([seg.rows, 1] if release == "consumer"
                  else [seg.tiles.block_rows, seg.tiles.col_tiles(8192)])
        assert seg.geometry(1, 8192) == [1, seg.row0, seg.rows, *blocks,
                                         int(release == "consumer")]
    text = (pathlib.Path(__file__).parents[1] / "csrc/ops.cu").read_text()
    assert "const SegmentGeometry g{list[0], list[1], list[2], list[3], list[4], list[5] != 0};" \
        in text
    assert "int64_t set, row0, seg_rows, block_rows, col_tiles;" in text

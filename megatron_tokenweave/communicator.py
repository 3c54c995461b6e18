"""The communicator: one owner of the fused op per (TP group, dtype, hidden size, device).

It owns the communication buffers (sized once: row-parallel GEMMs write partial sums into
`partial`, the fused op writes normed rows into `normed`, so the hot path neither allocates nor
copies), and on the kernel backend the symmetric buffer, the copy-engine mirror, the error words
and the C++ communicator (kernels.KernelComm). Everything that decides the protocol is settled
when it is created and **agreed by every rank** (`agree`): the backend, the kernel settings and the
`TOKENWEAVE_*` variables, checked equal everywhere with one all-reduce before any other
collective, so a variable set on one rank only, or a rank without the CUDA extension, is a clear
error on every rank instead of ranks that take different protocols and hang.

Backends: "kernel" (the CUDA P2P kernels, every rank a GPU of this node with peer access),
"collectives" (NCCL in the activations' dtype + add + norm: GPUs without peer access, e.g.
across nodes), "reference" (the fp32 torch.distributed definition: CPU and tests).

Failures surface: a kernel that gives up waiting for a peer writes NaN into its outputs, and
`record_errors()` (the woven block's last layer; captured into CUDA graphs too) copies the
error words to pinned memory without a sync; `raise_if_failed()` (the block's first layer, and
`raise_if_any_failed()` after every engine step) raises them as a RuntimeError.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_tokenweave.config import ENV_PREFIX, TokenWeaveConfig
from megatron_tokenweave.kernels.comm import KernelSettings
from megatron_tokenweave.log import log_once
from megatron_tokenweave.ops.collectives import allreduce_add_rmsnorm_collectives
from megatron_tokenweave.ops.fp8_operands import Fp8Operands
from megatron_tokenweave.ops.fp8_rows import BLOCK_COLS, FP8_DTYPE, scale_stride
from megatron_tokenweave.ops.gemm_emulation import reduce_owned, store_to_owners
from megatron_tokenweave.ops.reference import fused_allreduce_rmsnorm_reference
from megatron_tokenweave.ops.segments import SETS, Segments, fits_long_k, slot_rows
from megatron_tokenweave.ops.validate import (
    MAX_HIDDEN,
    MAX_RANKS,
    VECTOR_BYTES,
    Comm,
    Layout,
    Phase,
    TokenWeaveInputError,
    check_fused_args,
    check_gemm_operands,
    check_phase,
)

BACKENDS = ("auto", "kernel", "reference", "multimem")
# Variables that change what a rank does in the op or the schedule: every rank must see the same
# values (checked by `agree`): the config's TOKENWEAVE_<FIELD> variables, the tuning-table cache,
# and the kernel's protocol settings.
AGREED_ENV = (
    *(ENV_PREFIX + f.name.upper() for f in dataclasses.fields(TokenWeaveConfig) if f.init),
    "TOKENWEAVE_CACHE", "TOKENWEAVE_NO_BULK", "TOKENWEAVE_NO_ONESHOT", "TOKENWEAVE_NO_TWOSHOT",
    "TOKENWEAVE_DEBUG_LOCAL_STORES", "TOKENWEAVE_DEBUG_NO_CALL_CHECK",
    "TOKENWEAVE_KERNEL_TIMEOUT_S", "TOKENWEAVE_ALLOW_MULTIMEM",
)
TUNING_TABLES = "tuning tables in the cache (TOKENWEAVE_CACHE/tuning)"


class WorkspaceCapacityError(TokenWeaveInputError):
    """A forward has more token rows than the communicator's buffers were sized for."""


class KernelFailure(RuntimeError):
    """A TokenWeave kernel gave up waiting for a peer rank (a rank died, or the ranks' calls
    diverged): its outputs are NaN and the communicator stays unusable; restart the ranks."""


@dataclass(frozen=True)
class Agreement:
    """What every rank of a group settled on: the backend, why (when not the kernel), the
    kernel's settings, and the SMs of the group's smallest GPU (the communicating GEMM's CTA
    budget: its tile shapes and who releases its tiles follow from it, so every rank must
    count the same)."""

    backend: str
    reason: str
    settings: KernelSettings
    timeout_s: float
    sms: int
    multicast: bool = False  # backend "multimem": the kernel over a kernels.MulticastBuffer


def _digest(value: str | bytes | None) -> int:
    """A 62-bit fingerprint (equal on every rank for equal values; None: unset)."""
    data = b"\0unset" if value is None else value if isinstance(value, bytes) else value.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def _tables_digest() -> int:
    """Fingerprint of the cached tuning tables (names and contents) a policy may read."""
    from megatron_tokenweave.policy import CACHE_DIR

    folder = CACHE_DIR / "tuning"
    blob = b"".join(p.name.encode() + b"\0" + p.read_bytes()
                    for p in sorted(folder.glob("*.json"))) if folder.is_dir() else b""
    return _digest(blob)


def _collective_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _min_max(values: list[int], group: dist.ProcessGroup,
             device: torch.device) -> tuple[list[int], list[int]]:
    """Element-wise minimum and maximum over the group, in one all-reduce."""
    t = torch.tensor(values + [-v for v in values], dtype=torch.int64,
                     device=_collective_device(group, device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    n = len(values)
    out = t.tolist()
    return [-v for v in out[n:]], out[:n]


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _env_flag(env: dict[str, str | None], name: str) -> bool:
    value = env[name]
    if value is None or value.strip().lower() in ("", "0", "false", "no", "off"):
        return False
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    raise TokenWeaveInputError(f"{name}={value!r}: expected 0 or 1")


def _peer_reachable(group: dist.ProcessGroup, device: torch.device) -> tuple[bool, str]:
    """Whether every rank of `group` is a GPU of this node that this GPU can access directly
    (collective; every rank gets the same answer)."""
    world = dist.get_world_size(group)
    mine = (socket.gethostname(), device.index if device.index is not None else -1)
    everyone: list[tuple[str, int] | None] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    hosts = {entry[0] for entry in everyone if entry is not None}
    why = f"the TP group spans {len(hosts)} nodes" if len(hosts) != 1 else ""
    if not why:
        for _, index in everyone:
            if index != mine[1] and not torch.cuda.can_device_access_peer(mine[1], index):
                why = f"GPU {mine[1]} has no peer access to GPU {index}"
                break
    lows, _ = _min_max([0 if why else 1], group, device)
    if lows[0] == 1:
        return True, ""
    return False, why or "a peer GPU of the group has no peer access"


def agree(group: dist.ProcessGroup, device: torch.device, requested: str, hidden: int,
          key: str = "") -> Agreement:
    """Settle the backend and kernel settings on every rank of `group` (a collective).

    First one all-reduce of each rank's capabilities (device kind, CUDA extension loaded, SM
    count: the group's smallest is agreed) and of fingerprints of the requested backend and
    `key` (the caller's description of what it creates: hidden size, dtype, capacity), the
    AGREED_ENV variables and the cached tuning tables: a difference is a TokenWeaveInputError
    on every rank naming what differs. Only then the collectives that depend on those (peer
    reachability).
    """
    if requested not in BACKENDS:
        raise TokenWeaveInputError(f"backend must be one of {BACKENDS}, got {requested!r}")
    env = {name: os.environ.get(name) for name in AGREED_ENV}
    is_cuda = device.type == "cuda"
    ext = False
    if is_cuda and requested != "reference":
        from megatron_tokenweave import kernels

        ext = kernels.is_available()
    names = ["the requested backend and the communicator's size", *AGREED_ENV, TUNING_TABLES]
    digests = ([_digest(f"{requested}|{hidden}|{key}")] + [_digest(env[n]) for n in AGREED_ENV]
               + [_tables_digest()])
    sms = _sm_count(device) if is_cuda else 1
    lows, highs = _min_max([int(is_cuda), int(ext), sms, *digests], group, device)
    differ = [n for n, lo, hi in zip(names, lows[3:], highs[3:], strict=True) if lo != hi]
    if differ:
        raise TokenWeaveInputError(
            f"TokenWeave: the ranks of the TP group differ in {', '.join(differ)}; every rank "
            "must run with the same settings (they decide the communication protocol)")
    if lows[0] != highs[0]:
        raise TokenWeaveInputError("TokenWeave: some ranks of the TP group are on CUDA devices "
                                   "and some are not")
    timeout_raw = env["TOKENWEAVE_KERNEL_TIMEOUT_S"]
    try:
        timeout_s = 10.0 if timeout_raw is None else float(timeout_raw)
    except ValueError:
        timeout_s = -1.0
    if not timeout_s > 0:
        raise TokenWeaveInputError(
            f"TOKENWEAVE_KERNEL_TIMEOUT_S={timeout_raw!r}: expected a positive number of seconds")
    settings = dict(settings=KernelSettings(
        bulk=not _env_flag(env, "TOKENWEAVE_NO_BULK"),
        oneshot=not _env_flag(env, "TOKENWEAVE_NO_ONESHOT"),
        twoshot=not _env_flag(env, "TOKENWEAVE_NO_TWOSHOT"),
        local_stores_only=_env_flag(env, "TOKENWEAVE_DEBUG_LOCAL_STORES"),
        check_calls=not _env_flag(env, "TOKENWEAVE_DEBUG_NO_CALL_CHECK")), timeout_s=timeout_s,
        sms=lows[2])
    world = dist.get_world_size(group)
    if requested == "reference":
        return Agreement("reference", "requested", **settings)
    if requested == "multimem":  # opt-in, untested here: refused alike on every rank, or allowed
        from megatron_tokenweave.kernels.multicast import agreed_refusal

        refusal = agreed_refusal(group, device)
        if refusal is not None:
            raise TokenWeaveInputError(f"TokenWeave backend 'multimem' refused: {refusal.reason}")
    why = ""
    if world > MAX_RANKS:
        why = f"TP size {world} is above the kernel's {MAX_RANKS} ranks"
    elif hidden > MAX_HIDDEN:
        why = f"hidden size {hidden} is above the kernel's {MAX_HIDDEN}"
    elif not is_cuda:
        why = "the device is not a CUDA GPU"
    elif world < 2:
        why = "the TP group has one rank (nothing to communicate)"
    elif lows[1] == 0:
        why = ("the CUDA extension megatron_tokenweave._C could not be loaded on "
               + ("this rank" if not ext else "another rank"))
    else:
        ok, why = _peer_reachable(group, device)
        if ok:
            return Agreement("kernel", "", **settings, multicast=requested == "multimem")
    if requested in ("kernel", "multimem"):
        raise RuntimeError(f"TokenWeave backend {requested!r} was requested but cannot run: {why}")
    fallback = "collectives" if is_cuda else "reference"
    return Agreement(fallback, why, **settings)


class Communicator:
    """The fused op of one (TP group, dtype, hidden, device): buffers, agreed backend, kernel.

    `partial` and `normed`: [max_tokens, hidden] buffers; on the kernel backend both live in one
    symmetric (CUDA IPC) allocation mapped on every rank.
    """

    def __init__(self, group: dist.ProcessGroup, max_tokens: int, hidden: int,
                 dtype: torch.dtype, device: torch.device, backend: str = "auto") -> None:
        self.group = group
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.dtype = dtype
        self.device = device
        self.agreement = agree(group, device, backend, hidden, f"{dtype}|{max_tokens}")
        self.backend = self.agreement.backend
        if self.agreement.reason and self.backend != "kernel":
            mechanism = ("NCCL collectives in the model's dtype" if self.backend == "collectives"
                         else "the torch.distributed reference op")
            log_once(f"backend:{self.agreement.reason}",
                     f"TokenWeave: using {mechanism} ({self.agreement.reason})")
        numel = max_tokens * hidden
        self.symmetric = None
        self.kernel = None
        self._mirror = None  # prepare_copy_engine(), made on the first copy-engine forward
        self._inbox = None  # prepare_gemm(): kernels.GemmInbox, or the emulation's slots
        # prepare_gemm(): the fitted GEMM kernel runs on every rank (ops/segments.tiles_for may
        # pick it), and every rank's device has the rule for long-K calls of many tiles
        # (ops/segments.fits_long_k); both agreed over the group, so every rank picks alike
        self.fitted_gemm = False
        self.fitted_long_k = False
        self._fp8_rows = None  # prepare_fp8_rows(): (e4m3 rows, each half's scales)
        self._errors = None  # pinned int32 [ERROR_WORDS], copied by record_errors()
        if self.backend == "kernel":
            from megatron_tokenweave import kernels

            nbytes = 2 * numel * torch.finfo(dtype).bits // 8
            a = self.agreement
            buffer = kernels.MulticastBuffer if a.multicast else kernels.SymmetricBuffer
            self.symmetric = buffer(group, nbytes, device, timeout_s=a.timeout_s)
            self.kernel = kernels.KernelComm(self.symmetric, a.settings)
            self._errors = torch.zeros(kernels.ERROR_WORDS, dtype=torch.int32, pin_memory=True)
            flat = self.symmetric.local[:nbytes].view(dtype)
        else:
            flat = torch.empty(2 * numel, dtype=dtype, device=device)
        self.partial = flat[:numel].view(max_tokens, hidden)
        self.normed = flat[numel:].view(max_tokens, hidden)

    # -- the op -------------------------------------------------------------------------------
    def allreduce_rmsnorm(self, partial: torch.Tensor, residual: torch.Tensor,
                          weight: torch.Tensor | None, eps: float, residual_out: torch.Tensor,
                          normed_out: torch.Tensor | None, layout: Layout, *, ctas: int = 16,
                          comm: Comm = "fused", phase: Phase = "whole",
                          segments: Segments | None = None, set_index: int = 0, call: int = 0,
                          validate: bool = True) -> None:
        """y = sum over the TP group of `partial` + `residual`; normed = RMSNorm(y) * weight.

        partial: [C, n, H], C = TP size (sequence-parallel: chunk r is reduced onto rank r) or 1
            (replicated: every rank reduces every row). On the kernel backend it must lie in
            `self.partial` (the symmetric buffer peers read from).
        residual / residual_out: [n, H] this rank's rows (residual_out may alias residual).
        weight: [H] norm weight, or None to add only (then normed_out is None).
        normed_out: [C, n, H] with dense rows and any chunk stride: the normed rows of every
            chunk, on every rank. On the kernel backend it must lie in `self.normed`. Or, in
            the replicated layout, FP8 rows (ops.fp8_rows.Fp8Rows: any device memory), the
            normed rows quantized as the next linear's FP8 quantizer would.
        ctas: CTAs the kernel may use (the other backends ignore it).
        comm: "fused" (the backend's own mechanism), "copy_engine" (the kernel's copy-engine
            data path: prepare_copy_engine() first; on other backends the same as "fused"), or
            "collectives" (NCCL/gloo collectives in the activations' dtype, then add and norm;
            reduces in place in `partial`), or "gemm" (the consumer of `row_gemm`: the rows the
            GEMMs of every rank stored as `segments` into inbox set `set_index`).
        phase: "transfer" then "reduce" split the copy-engine op in two (where
            ops.validate.phases_apply); mechanisms without phases run whole at "reduce" and do
            nothing at "transfer".
        call: the caller's number for this call, the same on every rank (the woven layer's:
            layer, stage and half); the kernels check that every peer is on the same call
            (kernels.call_tag) and fail loudly where one is not. With comm="gemm" the same
            number as its `row_gemm`.
        validate: check the arguments in Python first (the kernel's C++ checks always run).
        """
        check_phase(phase, layout, weight)  # on every backend: a wrong phasing fails on CPU too
        kernel = self.backend == "kernel" and comm != "collectives"
        copy_engine = kernel and comm == "copy_engine"
        if phase == "transfer" and not copy_engine:
            return
        if comm == "gemm":
            self._reduce_owned(partial, residual, weight, eps, residual_out, normed_out, layout,
                               segments, set_index, ctas, call, validate)
            return
        if kernel:
            self.kernel.run(partial, residual, weight, eps, residual_out, normed_out, layout,
                            ctas=ctas, path="copy_engine" if copy_engine else "sm",
                            phase=phase if copy_engine else "whole", call=call,
                            validate=validate)
            return
        if validate:
            world = dist.get_world_size(self.group)
            check_fused_args(partial, residual, weight, residual_out, normed_out, layout, world)
        if comm == "collectives" or self.backend == "collectives":
            allreduce_add_rmsnorm_collectives(partial, residual, weight, eps, residual_out,
                                              normed_out, layout, self.group)
        else:
            fused_allreduce_rmsnorm_reference(partial, residual, weight, eps, residual_out,
                                              normed_out, layout, self.group)

    def prepare_copy_engine(self) -> None:
        """Allocate the copy-engine mirror of the peers' partial region ((TP size - 1) x the
        partial buffer) and hand it to the kernel. Never during a CUDA graph capture (its memory
        would belong to the graph's pool): a capture needs one eager forward of the same plan
        first, as every warm-up gives."""
        if self.backend != "kernel" or self._mirror is not None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise TokenWeaveInputError(
                "the copy-engine mirror is allocated on the first eager call; run one forward "
                "with comm='copy_engine' before capturing a CUDA graph")
        from megatron_tokenweave import kernels

        self._mirror = kernels.CopyEngineMirror(
            self.symmetric, self.partial.numel() * self.partial.element_size())
        self.kernel.attach_mirror(self._mirror)

    # -- FP8 normed rows ----------------------------------------------------------------------
    def prepare_fp8_rows(self) -> bool:
        """Allocate the FP8 normed-rows workspace (ops.fp8_rows: max_tokens x hidden e4m3 and
        each half's scales), local memory, once; the layers then share it as they share
        `normed`. Never during a CUDA graph capture (its memory would belong to the graph's
        pool): returns whether the workspace exists."""
        if self._fp8_rows is None and not (self.device.type == "cuda"
                                           and torch.cuda.is_current_stream_capturing()):
            scales = -(-self.hidden // BLOCK_COLS) * scale_stride(self.max_tokens)
            self._fp8_rows = (
                torch.empty(self.max_tokens, self.hidden, dtype=FP8_DTYPE, device=self.device),
                torch.empty(SETS, scales, dtype=torch.float32, device=self.device))
        return self._fp8_rows is not None

    def fp8_rows(self, set_index: int, offset: int, rows: int) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
        """Half `set_index`'s FP8 normed rows [1, rows, hidden] from row `offset` of the
        workspace (prepare_fp8_rows first), and the flat fp32 region for their scales."""
        data, scales = self._fp8_rows
        return data[offset: offset + rows].view(1, rows, self.hidden), scales[set_index]

    # -- the GEMM-fused mechanism -------------------------------------------------------------
    def prepare_gemm(self) -> None:
        """Make the inbox the communicating GEMM stores into (kernel backend: a peer-mapped
        buffer of about max_tokens x hidden per rank; elsewhere the emulation's slots). A
        collective on the kernel backend: every rank's plan picks the mechanism in the same
        forward. Never during a CUDA graph capture (as prepare_copy_engine)."""
        if self._inbox is not None:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise TokenWeaveInputError(
                "the GEMM-fused inbox is made on the first eager call; run one forward with "
                "comm='gemm' before capturing a CUDA graph")
        if self.backend == "kernel":
            from megatron_tokenweave.kernels._ext import fitted_gemm_available
            from megatron_tokenweave.kernels.inbox import GemmInbox

            _check_gemm_support(self.device)
            self._inbox = GemmInbox.create(self.group, self.max_tokens, self.hidden, self.dtype,
                                           self.device, self.agreement.timeout_s)
            self._inbox.attach(self.kernel.handle)
            fitted = fitted_gemm_available(self.device)
            long_k = fitted and fits_long_k(torch.cuda.get_device_name(self.device))
            # Every rank must pick the same tiles (their owners' rows, who releases them): the
            # group takes the fitted kernel and its device rule only where every rank has them.
            lows, _ = _min_max([int(fitted), int(long_k)], self.group, self.device)
            self.fitted_gemm, self.fitted_long_k = bool(lows[0]), bool(lows[1])
        else:
            world = dist.get_world_size(self.group)
            self._inbox = torch.zeros(world, slot_rows(self.max_tokens, world), self.hidden,
                                      dtype=self.dtype, device=self.device)

    def row_gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 segments: Segments, set_index: int, *, ctas: int, call: int = 0,
                 validate: bool = True, fp8: Fp8Operands | None = None) -> None:
        """The communicating row-parallel GEMM of one call: x [rows, K] @ weight^T (+ bias),
        each segment's rows stored into its owner's inbox set `set_index` (the consumer is
        allreduce_rmsnorm(comm="gemm") with the same segments, set and `call`). ctas: the
        persistent CTAs the GEMM may take (the kernel backend's SMs left beside the other
        half's op). fp8: x and weight are e4m3 with these scales (ops/fp8_operands.py; the
        segments made with fp8=fp8.scaling); the rows land in the communicator's dtype."""
        if validate:
            self._check_gemm(x, weight, bias, segments, set_index, fp8)
        if self.backend == "kernel":
            from megatron_tokenweave.kernels.owner_gemm import owner_gemm

            tag = self.kernel.gemm_tag(call, segments, set_index, weight.shape[0])
            owner_gemm(x, weight, bias, self._inbox, segments, set_index, ctas, tag,
                       validate=validate, fp8=fp8)
        else:
            store_to_owners(x, weight, bias, segments, self._inbox, self.group, fp8)

    def _check_gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    seg: Segments, set_index: int, fp8: Fp8Operands | None) -> None:
        if self._inbox is None:
            raise TokenWeaveInputError("the GEMM-fused mechanism needs prepare_gemm() first")
        if set_index not in range(SETS):
            raise TokenWeaveInputError(f"set_index must be 0 or 1, got {set_index!r}")
        if x.dim() == 2 and x.shape[1] * x.element_size() % VECTOR_BYTES:
            raise TokenWeaveInputError(
                f"row_gemm: K = {x.shape[1]} {x.dtype} elements are not whole 16-byte vectors")
        check_gemm_operands(x, weight, "row_gemm")
        if fp8 is not None:
            fp8.check(x, weight)
        elif x.dtype != self.dtype or weight.dtype != self.dtype:
            raise TokenWeaveInputError(
                f"row_gemm: x and weight must be {self.dtype} (the communicator's dtype) or "
                f"e4m3 with their scales (fp8=), got {x.dtype} and {weight.dtype}")
        if bias is not None and bias.dtype != self.dtype:
            raise TokenWeaveInputError(
                f"row_gemm: the bias must be {self.dtype} (the communicator's dtype), got "
                f"{bias.dtype}")
        if weight.shape != (self.hidden, x.shape[1]) or (
                bias is not None and tuple(bias.shape) != (self.hidden,)):
            raise TokenWeaveInputError(
                f"row_gemm: weight must be [{self.hidden}, {x.shape[1]}] and bias [{self.hidden}], "
                f"got {tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
        world = dist.get_world_size(self.group)
        last = seg.input_rows(world)
        if last > x.shape[0]:
            raise TokenWeaveInputError(
                f"row_gemm: the segments read input rows up to {last}, x has {x.shape[0]}")
        if seg.row0 + seg.rows > slot_rows(self.max_tokens, world):
            raise WorkspaceCapacityError(
                f"row_gemm: inbox rows up to {seg.row0 + seg.rows} exceed the "
                f"{slot_rows(self.max_tokens, world)} rows of a slot; raise max_tokens")

    def _reduce_owned(self, partial: torch.Tensor, residual: torch.Tensor,
                      weight: torch.Tensor | None, eps: float, residual_out: torch.Tensor,
                      normed_out: torch.Tensor | None, layout: Layout, seg: Segments | None,
                      set_index: int, ctas: int, call: int, validate: bool) -> None:
        if validate:
            world = dist.get_world_size(self.group)
            check_fused_args(partial, residual, weight, residual_out, normed_out, layout, world)
            if seg is None or self._inbox is None:
                raise TokenWeaveInputError(
                    "comm='gemm' consumes a row_gemm call: pass its segments (after "
                    "prepare_gemm())")
            rows = partial.shape[0] * partial.shape[1]
            if seg.total != rows:
                raise TokenWeaveInputError(
                    f"comm='gemm': the segments cover {seg.total} rows, this call has {rows}: "
                    "pass the segments of the row_gemm call that made its rows")
        if self.backend == "kernel":
            self.kernel.reduce_owned(partial, residual, weight, eps, residual_out, normed_out,
                                     layout, seg, set_index, ctas=ctas, call=call,
                                     validate=validate)
        else:
            reduce_owned(self._inbox, seg, partial, residual, weight, eps, residual_out,
                         normed_out, layout, self.group)

    # -- failures -----------------------------------------------------------------------------
    def record_errors(self) -> None:
        """Queue a copy of the kernel's error words to pinned memory on the current stream (no
        sync; inside a CUDA graph capture it becomes part of the graph, so every replay
        refreshes them)."""
        if self.kernel is not None:
            torch.ops.tokenweave.comm_copy_errors(self.kernel.handle, self._errors)

    def raise_if_failed(self) -> None:
        """Raise KernelFailure if a kernel of this rank gave up waiting for a peer, as of the
        last copy that completed (never synchronizes; this rank only). The message names the
        peer, the barrier slot and the timeout. The communicator is unusable afterwards (its
        kernels write NaN)."""
        if self._errors is None:
            return
        message = self.symmetric.describe_error(*self._errors.tolist())
        if message is not None:
            raise KernelFailure(message)

    def raise_if_failed_anywhere(self) -> None:
        """Collective over the group (reads the device's error words: synchronizes): every rank
        raises KernelFailure if a kernel of any rank gave up, with its own message or the failed
        rank's number, so no rank is left inside a collective the others skip."""
        if self.symmetric is None:
            return
        words = [int(w) for w in self.symmetric.error_words().tolist()]
        failed = words[0] != 0
        _, highs = _min_max([int(failed), dist.get_rank(self.group) if failed else -1],
                            self.group, self.device)
        if highs[0]:
            raise KernelFailure(self.symmetric.describe_error(*words) or (
                f"tokenweave kernel on rank {highs[1]} of the TP group gave up waiting for a "
                "peer (its own error names which); this rank's outputs are NaN too"))

    # -- capacity and lifetime ----------------------------------------------------------------
    def is_buffer_size_sufficient(self, rows: int) -> bool:
        return rows <= self.max_tokens

    def check_capacity(self, rows: int) -> None:
        if not self.is_buffer_size_sufficient(rows):
            raise WorkspaceCapacityError(
                f"this forward has {rows} token rows but the TokenWeave workspace holds "
                f"{self.max_tokens}; raise TokenWeaveConfig.max_tokens (TOKENWEAVE_MAX_TOKENS)"
            )

    def destroy(self) -> None:
        """Free the kernel, mirror, inbox and buffer (collective on the kernel backend)."""
        if self.kernel is not None and self._inbox is not None:
            self._inbox.close()  # synchronizes: no GEMM stores into it any more
        self._inbox = None
        if self.kernel is not None:
            self.kernel.close()
            self.kernel = None
        if self.symmetric is not None:
            self.symmetric.close()  # synchronizes: no copy into the mirror is still running
            self.symmetric = None
        self._mirror = None
        self._errors = None


def _check_gemm_support(device: torch.device) -> None:
    """The GEMM-fused mechanism's kernels need Triton with Gluon (3.6 or newer) and TMA (sm_90
    or newer): a clear error on every rank before its inbox is made (every rank of a node has
    the same GPUs and packages)."""
    try:
        import megatron_tokenweave.kernels.owner_gemm  # noqa: F401 (both kernels)
    except (ImportError, AttributeError) as exc:
        raise TokenWeaveInputError(
            f"comm='gemm' needs triton 3.6 or newer with Gluon ({exc})") from None
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise TokenWeaveInputError(
            f"comm='gemm' needs TMA (sm_90 or newer); this GPU is sm_{major}{minor}")


_communicators: dict[tuple, Communicator] = {}
# Communicators outgrown by a larger max_tokens: kept until destroy_communicators(), since CUDA
# graphs captured on them (and their copy-engine mirrors) replay with their addresses.
_outgrown: list[Communicator] = []


def get_communicator(group: dist.ProcessGroup, max_tokens: int, hidden: int,
                     dtype: torch.dtype, device: torch.device, backend: str) -> Communicator:
    """The communicator of this group/dtype/hidden/device, created on first use (a collective).
    Every woven layer of a key shares it (a layer hands its normed rows to the next in it); a
    larger max_tokens replaces it with a larger one and keeps the old one alive."""
    key = _key(group, hidden, dtype, device, backend)
    comm = _communicators.get(key)
    if comm is None or comm.max_tokens < max_tokens:
        if comm is not None:
            log_once(f"outgrown:{key}:{max_tokens}",
                     f"TokenWeave: a workspace of {comm.max_tokens} rows is outgrown by "
                     f"max_tokens={max_tokens}; both stay allocated (give every model the "
                     f"largest max_tokens to avoid it)")
            _outgrown.append(comm)
        comm = _communicators[key] = Communicator(group, max_tokens, hidden, dtype, device,
                                                  backend)
    return comm


def find_communicator(group: dist.ProcessGroup, hidden: int, dtype: torch.dtype,
                      device: torch.device, backend: str) -> Communicator | None:
    """The communicator of this key if one exists (never creates one: no collective)."""
    return _communicators.get(_key(group, hidden, dtype, device, backend))


def _key(group: dist.ProcessGroup, hidden: int, dtype: torch.dtype, device: torch.device,
         backend: str) -> tuple:
    return (group, hidden, dtype, device, backend)


def _every() -> list[Communicator]:
    """Every communicator of this process, in creation order (the same on every rank)."""
    return [*_outgrown, *_communicators.values()]


def kernels_live() -> bool:
    """Whether any communicator of this process runs the CUDA kernels."""
    return any(comm.kernel is not None for comm in _every())


def raise_if_any_failed() -> None:
    """Collective (every rank of every live communicator's group calls it, in the same place):
    raise KernelFailure on every rank if a kernel of any rank gave up. Synchronizes. The serving
    wrappers call it after every forward, where CUDA graphs replay without Python layers.
    Communicators are visited in creation order, the same on every rank."""
    for comm in _every():
        comm.raise_if_failed_anywhere()


def destroy_communicators() -> None:
    """Free every communicator (a collective of each TP group; before destroying process
    groups). Nothing captured on them may replay afterwards."""
    for comm in _every():
        comm.destroy()
    _communicators.clear()
    _outgrown.clear()

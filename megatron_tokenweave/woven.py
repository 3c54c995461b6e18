"""One woven forward of one layer: its mixer stages (megatron_tokenweave.stages) in order, as
the schedule reads (DESIGN.md's timeline, here for a GPTModel layer: attention + MLP):

    main stream                          side stream
    qkv(A)                               fused op(B) of the previous layer's last stage (deferred)
    qkv(B), attention (whole), proj(A)
    proj(B)                              fused op(A): all-reduce + add + the MLP stage's RMSNorm
    MLP(A)                               fused op(B)
    MLP(B)                               fused op(A): all-reduce + add + next layer's RMSNorm
                                         fused op(B) -> handed to the next layer

A hybrid layer is one stage: its fused ops normalize for the next layer's stage, so the chain of
stages runs across layers the same way. A WovenForward holds what one forward needs (geometry,
plan, halves, buffer views, side stream, communicator) and runs the steps: `inputs` (the hand-off
or the input norm), `stage` once per mixer stage, `hand_off`. Every fused op starts through
`launch`, called once per half as that half's row-parallel partial sum is queued (the row
linear's `after`; the MoE expert layer's end). The linears receive their per-half plans through
one mechanism: linears.weaving(). With the GEMM-fused mechanism the row linears run `row_gemm`
(the communicating GEMM) and `launch` starts its consumer.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_tokenweave import fp8_gemm, moe
from megatron_tokenweave.communicator import Communicator
from megatron_tokenweave.linears import Weave, WrittenInput, weaving
from megatron_tokenweave.log import log_once
from megatron_tokenweave.ops.segments import Segments, half_segments
from megatron_tokenweave.ops.validate import Layout, phases_apply
from megatron_tokenweave.policy import Plan
from megatron_tokenweave.schedule import Half, Handoff, Pending, SideStream
from megatron_tokenweave.stages import MixerStage

Norm = tuple[torch.Tensor, float]  # (weight, eps) of an RMSNorm the fused op applies


@dataclass
class Ops:
    """The fused ops after one stage's row-parallel linear: the residual rows they add, the
    norm they apply (None: add only), their CTAs beside the other half, and each half's
    pending op. `target`: the input quantizer of the linear after them where they write its
    input in FP8 (fp8_gemm.fused_quantizer), with `written` each half's quantized storage."""

    residual: torch.Tensor
    norm: Norm | None
    ctas: int
    ops: list[Pending] = field(default_factory=list)
    target: Any | None = None
    written: list[Any] = field(default_factory=list)

    def written_input(self) -> WrittenInput | None:
        """What the next stage's column linear takes in place of bf16 rows (None: bf16)."""
        return None if self.target is None else WrittenInput(self.target, tuple(self.written))


def gemm_ctas(comm: Communicator, plan: Plan, split: bool) -> int:
    """Persistent CTAs of the communicating GEMM: every SM unsplit; beside the other half's op,
    the SMs that op leaves (a CTA waiting for an SM would finish its tiles last). The SMs are
    the communicator's agreed count, and its fitted-kernel flags are agreed too (prepare_gemm),
    so every rank picks the same tiles and release."""
    if comm.device.type != "cuda":
        return 1  # the emulation ignores it
    beside = max(plan.comm_ctas_attn, plan.comm_ctas_mlp) if split else 0
    return max(1, comm.agreement.sms - beside)


class WovenForward:
    """One layer's woven forward over hidden states x [s, b, H] (s: this rank's rows)."""

    def __init__(self, x: torch.Tensor, world: int, rank: int, sequence_parallel: bool,
                 comm: Communicator, plan: Plan, halves: tuple[Half, ...], side: SideStream,
                 validate: bool, fp8: bool = False) -> None:
        self.world, self.rank = world, rank
        self.layout = Layout.SEQUENCE_PARALLEL if sequence_parallel else Layout.REPLICATED
        self.s_local, self.batch, hidden = x.shape
        self.chunks = self.world if sequence_parallel else 1
        n = self.s_local * self.batch
        self.comm, self.plan, self.halves, self.side = comm, plan, halves, side
        self.split = len(halves) > 1
        self.validate = validate
        self.fp8 = fp8  # the linears run TE's FP8 GEMMs (linears.Weave.fp8)
        # Views: every chunk's normed rows (the GEMMs' input), each half's partial sums (both in
        # the communicator's buffers), this layer's residual in and out.
        self.normed = comm.normed[: self.chunks * n].view(self.chunks, n, hidden)
        self.partials = tuple(
            comm.partial[self.chunks * h.offset: self.chunks * (h.offset + h.rows)].view(
                self.chunks, h.rows, hidden)
            for h in halves)
        self.residual_in = x.view(n, hidden)
        self.out = torch.empty_like(x)
        self.residual_out = self.out.view(n, hidden)
        # GEMM-fused mechanism: the segments of the GEMM just issued for each half (its consumer
        # takes the same), and the SMs the GEMM leaves to the other half's op.
        self.gemm_segments: list[Segments | None] = [None] * len(halves)
        self.gemm_ctas = gemm_ctas(comm, plan, self.split) if self.fused_gemm else 0
        self.site = 0  # the stage running (`stage`): its calls are site * 2 + half

    @property
    def fused_gemm(self) -> bool:
        """Whether the row-parallel GEMMs communicate themselves (the GEMM-fused mechanism)."""
        return self.plan.comm == "gemm"

    # ------------------------------------------------------------------ the one launch
    def launch(self, ops: Ops, i: int) -> None:
        """Half i's fused op: on the main stream when unsplit, else on the side stream; the
        copy-engine op there only moves the rows, its reduction waits for the consumer."""
        half = self.halves[i]
        rows = slice(half.offset, half.offset + half.rows)
        weight, eps = ops.norm if ops.norm is not None else (None, 0.0)
        normed = half.of(self.normed) if weight is not None else None
        if ops.target is not None and weight is not None:  # the next linear's FP8 input
            data, scales = self.comm.fp8_rows(i, half.offset, half.rows)
            normed, storage = fp8_gemm.written_input(ops.target, data, scales, self.normed.dtype)
            ops.written.append(storage)
        run = functools.partial(
            self.comm.allreduce_rmsnorm, self.partials[i], ops.residual[rows], weight, eps,
            self.residual_out[rows], normed, self.layout, comm=self.plan.comm,
            segments=self.gemm_segments[i], set_index=i, call=self.site * 2 + i,
            validate=self.validate)
        if not self.split:
            run(ctas=self.plan.comm_ctas_alone)
            ops.ops.append(Pending())
        elif self.plan.comm == "copy_engine" and phases_apply(self.layout, weight):
            with self.side.run():
                run(ctas=ops.ctas, phase="transfer")
            ops.ops.append(Pending(self.side.record(),
                                     functools.partial(run, ctas=ops.ctas, phase="reduce")))
        else:
            with self.side.run():
                run(ctas=ops.ctas)
            ops.ops.append(Pending(self.side.record()))

    def row_gemm(self, i: int, x: torch.Tensor, rows: Half, weight: torch.Tensor,
                 bias: torch.Tensor | None, fp8: fp8_gemm.Fp8Gemm | None = None) -> None:
        """Half i's communicating GEMM (GEMM-fused mechanism) over rows `rows` of every chunk of
        x [chunks, n, K]: its tiles go to their owners' inbox set i, where half i's rows of the
        layer sit (the woven halves never share inbox rows). fp8: the module's FP8 GEMM, whose
        quantizer takes the half's rows (replicated layout: one chunk, its rows contiguous) and
        whose FP8 weight the GEMM multiplies them with."""
        ops = None
        if fp8 is not None:
            x, weight, ops = fp8.operands(rows.of(x)[0])
            first, stride = 0, rows.rows
        else:
            x, first, stride = x.reshape(-1, x.shape[-1]), rows.offset, x.shape[1]
        seg = half_segments(self.layout, self.world, self.halves, i, hidden=weight.shape[0],
                            k=weight.shape[1], ctas=self.gemm_ctas, first=first,
                            chunk_stride=stride, fitted=self.comm.fitted_gemm,
                            fp8=None if ops is None else ops.scaling,
                            long_k=self.comm.fitted_long_k)
        self.gemm_segments[i] = seg
        self.comm.row_gemm(x, weight, bias, seg, i, ctas=self.gemm_ctas, call=self.site * 2 + i,
                           validate=self.validate, fp8=ops)

    # ------------------------------------------------------------------ the steps
    def inputs(self, handoff: Handoff | None, input_norm: torch.nn.Module,
               group: dist.ProcessGroup, x: torch.Tensor,
               column: torch.nn.Module | None) -> tuple[tuple[Pending, ...], WrittenInput | None]:
        """Per half, the op still writing this layer's normed input, and that input where the
        predecessor wrote it in FP8 for `column` (this layer's first linear): the predecessor's
        hand-off when it wrote into these very rows (in FP8: for this very quantizer, this call
        in FP8 too), else the input norm computed here now."""
        done = tuple(Pending() for _ in self.halves)
        if handoff is not None:
            same = (handoff.normed.data_ptr() == self.normed.data_ptr()
                    and handoff.normed.shape == self.normed.shape)
            written = handoff.written
            if written is not None:
                if (handoff.halves == self.halves and self.fp8
                        and fp8_gemm.fused_quantizer(column) is written.quantizer):
                    return handoff.pending, written
                log_once("fp8-handoff", "TokenWeave: a layer's input was written in FP8 for a "
                         "linear that does not take it now (another FP8 state, or not FP8); "
                         "its input norm runs again")
                same = False  # the bf16 rows were not written
            elif same and handoff.halves == self.halves:
                return handoff.pending, None
            handoff.wait()  # another split, or another buffer (a workspace outgrown between)
            if same:
                return done, None
        local = input_norm(x).reshape(-1, x.shape[-1]).to(self.normed.dtype)
        if self.layout is Layout.SEQUENCE_PARALLEL:
            flat = self.normed.view(-1, x.shape[-1])
            dist.all_gather_into_tensor(flat, local.contiguous(), group=group)
        else:
            self.normed[0].copy_(local)
        return done, None

    def fp8_target(self, column: torch.nn.Module | None) -> Any | None:
        """The input quantizer of `column`, the linear after a stage's fused ops, where those
        ops (the GEMM-fused mechanism's consumers too) write its input in FP8 (ops.fp8_rows:
        replicated layout, this call in FP8, the workspace made); None: they write bf16 rows,
        the linear quantizes them itself."""
        if not self.fp8 or column is None or self.layout is not Layout.REPLICATED:
            return None
        quantizer = fp8_gemm.fused_quantizer(column)
        if quantizer is None or not self.comm.prepare_fp8_rows():
            return None
        return quantizer

    def stage(self, stage: MixerStage, inputs: Sequence[Pending], residual: torch.Tensor,
              next_norm: Norm | None, kwargs: Mapping[str, Any], site: int,
              written: WrittenInput | None = None, target: Any | None = None) -> Ops:
        """One mixer stage over the normed rows, each half's fused op (residual add + the next
        stage's norm, or add only where none follows) launched as soon as that half's partial
        sum is queued. Token-wise mixers run half by half, each half after its input arrived;
        the others run their core on all rows, their first linear per half as its input
        arrives and their last linear per half. `site`: the stage's place in the model, the
        same on every rank: its ops and communicating GEMMs are calls site * 2 + half.
        `written`: the stage's input as the ops before wrote it in FP8 (None: bf16 rows);
        `target`: the next linear's quantizer its own ops write for (fp8_target)."""
        self.site = site
        ops = Ops(residual, next_norm,
                  self.plan.comm_ctas_mlp if stage.tokenwise else self.plan.comm_ctas_attn,
                  target=target if next_norm is not None else None)
        if not stage.tokenwise:
            plans = {
                stage.column: Weave(self.chunks, self.halves, before=lambda i: inputs[i].wait(),
                                    fp8=self.fp8, written=written),
                stage.row: Weave(self.chunks, self.halves, partials=self.partials,
                                 add_bias=self.rank == 0, after=lambda i: self.launch(ops, i),
                                 gemm=self.row_gemm if self.fused_gemm else None, fp8=self.fp8),
            }
            with weaving(plans):
                stage.mixer(self.normed.view(self.chunks * self.s_local, self.batch, -1),
                            **kwargs)
            return ops
        for i, half in enumerate(self.halves):
            inputs[i].wait()
            x = half.of(self.normed)
            if stage.is_moe:
                moe.moe_partial(stage.mixer, x, self.partials[i])
                self.launch(ops, i)
                continue
            whole = (Half(0, x.shape[1]),)
            mine = None if written is None else WrittenInput(written.quantizer,
                                                             (written.halves[i],))
            plans = {
                stage.column: Weave(self.chunks, whole, fp8=self.fp8, written=mine),
                stage.row: Weave(self.chunks, whole, partials=(self.partials[i],),
                                 add_bias=self.rank == 0,
                                 after=lambda _, i=i: self.launch(ops, i),
                                 gemm=(lambda _, *args, i=i: self.row_gemm(i, *args))
                                 if self.fused_gemm else None, fp8=self.fp8),
            }
            with weaving(plans):
                stage.mixer(x)
        return ops

    def hand_off(self, last: Ops, defer: bool) -> Handoff:
        """What the next layer receives: this layer's output, its normed input and, per half,
        the op of the layer's last stage still writing them (joined here unless `defer`)."""
        pending = tuple(last.ops)
        if not defer:
            for op in pending:
                op.wait()
            pending = tuple(Pending() for _ in self.halves)  # a capture may not wait on others'
        return Handoff(self.out, self.normed, self.halves, pending, last.written_input(),
                       reads=(last.residual,) if defer else ())

"""Linears of the woven layer: Megatron's own column/row-parallel linears (local or TE), same
parameters and checkpoint keys, that run a per-half schedule when the layer hands them a weave.

Without a weave they behave exactly like their stock parents (the fallback path). The layer hands
each linear its plan for one call through one mechanism, `weaving({linear: Weave, ...})`, a
context the linears read (nothing on the modules changes). With a plan:
- a column-parallel linear takes the already-gathered normed input (no all-gather of its own)
  and computes it half by half, waiting for each half's communication to finish;
- a row-parallel linear writes its un-reduced partial sum of each half straight into the
  communication workspace (or, GEMM-fused, runs the communicating GEMM the plan hands it) and
  calls back, so the layer can launch that half's fused op at once.
The GEMMs run in the activations' dtype, or, for TE linears inside an enabled FP8 autocast,
as TE's FP8 GEMMs with the module's quantizers (megatron_tokenweave.fp8_gemm).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_tokenweave import fp8_gemm
from megatron_tokenweave.schedule import Half


def _bias(module: torch.nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) and bias.numel() > 0 else None


def gemm_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out[C, r, D] = x[C, r, H] @ weight[D, H]^T without copies: the chunk stride of x and out
    may exceed r rows (a half of every chunk), which a strided-batched GEMM takes as it is."""
    if x.shape[0] == 1:
        torch.matmul(x[0], weight.t(), out=out[0])
    else:
        torch.bmm(x, weight.t().expand(x.shape[0], -1, -1), out=out)


# (x [C, r, in], out [C, r, out], bias or None): out = x @ W^T (+ bias), every chunk
ChunkGemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], None]


@contextlib.contextmanager
def _gemms(module: torch.nn.Module, x: torch.Tensor, fp8: bool,
           written: WrittenInput | None = None) -> Iterator[ChunkGemm]:
    """The module's GEMM for one woven call on input x: TE's FP8 GEMM per chunk (each chunk's
    rows of a half are contiguous, as TE's GEMM wants them) where the layer runs this call in
    FP8 (`fp8`: a TE linear inside an enabled FP8 autocast), else one strided-batched GEMM in
    the activations' dtype. `written`: the input the fused op wrote in FP8 (its halves are then
    handed to the GEMM in place of x's rows)."""
    if fp8:
        # One row is what TE's forward preparation reads (device, dtype); a whole non-contiguous
        # input would be copied there.
        with fp8_gemm.gemms(module, x[0, :1],
                            written.quantizer if written is not None else None) as gemm:
            def per_chunk(x3: Any, out3: torch.Tensor, bias: torch.Tensor | None) -> None:
                if not isinstance(x3, torch.Tensor):  # written in FP8: one chunk (replicated)
                    gemm(x3, out3[0], bias)
                    return
                for c in range(x3.shape[0]):
                    gemm(x3[c], out3[c], bias)

            yield per_chunk
        return

    def native(x3: torch.Tensor, out3: torch.Tensor, bias: torch.Tensor | None) -> None:
        gemm_into(x3, module.weight, out3)
        if bias is not None:
            out3.add_(bias)

    yield native


@dataclass(frozen=True)
class WrittenInput:
    """A column linear's input the fused ops before it wrote in FP8 (fp8_gemm.written_input):
    the quantizer it was written for and, per half, TE's quantized storage of its rows."""

    quantizer: Any
    halves: tuple[Any, ...]


@dataclass
class Weave:
    """One call's plan: inputs viewed as [chunks, rows_per_chunk, features], split in `halves`.

    before(i): called before half i's GEMM (the layer makes the stream wait for its input).
    partials: row-parallel only: half i's [chunks, rows, out] destination in the workspace.
    after(i): row-parallel only: called once half i's partial sum is queued.
    add_bias: row-parallel only: whether this rank adds the bias into its partial sum (one rank
        does, so the reduction adds it once).
    gemm(i, x, half, weight, bias, fp8): row-parallel only, the GEMM-fused mechanism: computes
        half i (rows `half` of every chunk of x [chunks, rows, in]) with the communicating GEMM
        instead of writing `partials` (bias: the one to add, or None; fp8: the module's FP8
        GEMM (fp8_gemm.Fp8Gemm) whose operands it takes, or None in 16 bits).
    fp8: the call's GEMMs are TE's FP8 ones (the layer decides: fp8_gemm.active() on TE
        linears, the rows whole 16-row granules).
    written: column-parallel only: the input the fused ops wrote in FP8 for this linear (its
        GEMMs take those halves; nothing is quantized again), or None.

    A weave runs once, on exactly the rows its halves cover: a mixer that called its linear
    twice in one stage, or on other rows, would have its halves launched on the wrong data, so
    either is an error.
    """

    chunks: int
    halves: tuple[Half, ...]
    before: Callable[[int], None] | None = None
    partials: tuple[torch.Tensor, ...] = ()
    after: Callable[[int], None] | None = None
    add_bias: bool = False
    gemm: Callable[[int, torch.Tensor, Half, torch.Tensor, torch.Tensor | None, Any], None] | None \
        = None
    fp8: bool = False
    written: WrittenInput | None = None
    used: bool = field(default=False, init=False)

    def _input(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x as [chunks, rows, features], once, with the rows the halves cover."""
        rows = self.halves[-1].offset + self.halves[-1].rows
        if self.used or x.numel() != self.chunks * rows * x.shape[-1]:
            raise RuntimeError(
                f"TokenWeave: {type(module).__name__} was called "
                f"{'twice' if self.used else f'on {x.numel() // x.shape[-1]} rows'} in one woven "
                f"stage, which plans one call on {self.chunks * rows} rows; this mixer cannot "
                "be woven")
        self.used = True
        return x.reshape(self.chunks, rows, x.shape[-1])

    def column(self, module: torch.nn.Module,
               x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = module.weight, _bias(module)
        skip = bool(getattr(module, "skip_bias_add", False))
        x3 = self._input(module, x)
        out = x3.new_empty(self.chunks, x3.shape[1], weight.shape[0])
        with _gemms(module, x3, self.fp8, self.written) as gemm:
            for i, half in enumerate(self.halves):
                if self.before is not None:
                    self.before(i)
                rows = half.of(x3) if self.written is None else self.written.halves[i]
                gemm(rows, half.of(out), None if skip else bias)
        return out.view(*x.shape[:-1], weight.shape[0]), (bias if skip else None)

    def row(self, module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        weight, bias = module.weight, _bias(module)
        bias = bias if self.add_bias else None
        x3 = self._input(module, x)
        if self.gemm is None:
            scope = _gemms(module, x3, self.fp8)
        elif self.fp8:  # the communicating GEMM takes the module's FP8 operands
            scope = fp8_gemm.gemms(module, x3[0, :1])
        else:
            scope = contextlib.nullcontext()
        with scope as gemm:
            for i, half in enumerate(self.halves):
                if self.before is not None:
                    self.before(i)
                if self.gemm is not None:
                    self.gemm(i, x3, half, weight, bias, gemm)
                else:
                    gemm(half.of(x3), self.partials[i], bias)
                if self.after is not None:
                    self.after(i)
        return self.partials[-1], None


_plans: ContextVar[Mapping[torch.nn.Module, Weave] | None] = ContextVar("tokenweave_weaves",
                                                                        default=None)


@contextlib.contextmanager
def weaving(plans: Mapping[torch.nn.Module, Weave]) -> Iterator[None]:
    """Inside the scope, each linear in `plans` runs its Weave instead of its stock forward.
    A linear whose forward Megatron's FP8 inference padding wrapped (an instance attribute:
    fp8_utils.prepare_model_for_fp8_inference, which Megatron's inference wrappers apply to
    every TE linear of an FP8 model) runs its class's forward here: the weave's rows are
    already whole FP8 granules, and the wrapper would pad a half's rows (or, with sequence
    parallelism, all-gather the gathered input again)."""
    token = _plans.set(plans)
    wrapped = {m: m.__dict__.pop("forward") for m in plans if _padded_for_fp8(m)}
    try:
        yield
    finally:
        for module, forward in wrapped.items():
            module.forward = forward
        _plans.reset(token)


def _padded_for_fp8(module: torch.nn.Module) -> bool:
    """Whether Megatron's FP8 inference padding wrapped this module's forward."""
    return "forward" in module.__dict__ and module in _FP8_PADDED


try:  # the modules Megatron's FP8 inference padding wrapped (a weak set; none without TE)
    from megatron.core.fp8_utils import _fp8_inference_wrapped_modules as _FP8_PADDED
except ImportError:
    _FP8_PADDED = ()


class WovenLinearMixin:
    """Stock forward unless the layer handed this linear a Weave (`weaving`) for this call."""

    _woven_role = "column"

    def forward(self, input_: torch.Tensor, *args: Any,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        plans = _plans.get()
        weave = plans.get(self) if plans is not None else None
        if weave is None:
            return super().forward(input_, *args, **kwargs)
        return getattr(weave, self._woven_role)(self, input_)


class WovenColumnParallelLinear(WovenLinearMixin, ColumnParallelLinear):
    """ColumnParallelLinear whose woven forward takes the gathered normed input."""


class WovenRowParallelLinear(WovenLinearMixin, RowParallelLinear):
    """RowParallelLinear whose woven forward returns un-reduced partial sums in the workspace."""

    _woven_role = "row"


try:  # TE flavour: only where TransformerEngine imports (never on CPU machines).
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TERowParallelLinear,
    )

    class WovenTEColumnParallelLinear(WovenLinearMixin, TEColumnParallelLinear):
        """TEColumnParallelLinear (no fused norm) whose woven forward takes the gathered input."""

    class WovenTERowParallelLinear(WovenLinearMixin, TERowParallelLinear):
        """TERowParallelLinear whose woven forward returns un-reduced partial sums."""

        _woven_role = "row"

    HAVE_TE_LINEARS = True
except Exception:  # noqa: BLE001 - any TE import failure means "no TE flavour"
    WovenTEColumnParallelLinear = None  # type: ignore[assignment,misc]
    WovenTERowParallelLinear = None  # type: ignore[assignment,misc]
    HAVE_TE_LINEARS = False


def te_available() -> bool:
    """Whether TransformerEngine imports here, and with it the TE flavour (never true on our
    CPU machines)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE) and HAVE_TE_LINEARS

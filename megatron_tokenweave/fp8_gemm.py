"""FP8 GEMMs of the woven TE linears, under the FP8 context Megatron's block enters.

A woven linear computes its rows half by half (linears.Weave), so it cannot hand its input to
TE's module forward, which would quantize, multiply and (row-parallel) all-reduce all rows at
once. It runs the same pieces itself, taken from the module, so that what a stock forward
keeps stays as the stock forward keeps it:

- `prepare_forward` once per call: FP8 metadata initialised and, for delayed scaling, the
  module's amax and scale registered for the autocast's reduction, as in a stock forward;
- the weight quantized by the module's weight quantizer into the module's own workspace cache,
  following Megatron's `is_first_microbatch` rule (quantized at the first forward, reused after;
  under CUDA-graph capture the skip-update flag), so stock and woven forwards share one FP8
  weight;
- each half's input quantized by the module's input quantizer, then TE's GEMM writes into the
  destination the weave gives (the communicator's partial-sum rows: no copy).

Per-half quantization against the stock whole-call one: delayed scaling uses the one known scale
for both halves and its amax accumulates (a max) over both, so the FP8 input and the recorded
amax equal the stock forward's; blockwise scaling (1 x 128 activation blocks) is row-local, so the
halves' FP8 data equal the stock forward's. Current (tensorwise) scaling takes each half's own
amax and scale (each chunk's half with sequence parallelism, one GEMM per chunk): a
stock-identical scale would need the other half's rows before the first half's GEMM, the wait
the schedule exists to avoid, and a scale over fewer rows is never coarser than one over all of
them. The input is already gathered here, so no amax is reduced across ranks.

Where the fused op before a column linear writes that linear's input already quantized
(ops.fp8_rows: delayed and blockwise scaling, replicated layout), the GEMM takes it as TE's
quantized storage (`written_input`) and nothing is quantized again: the same FP8 data and, for
delayed scaling, the same amax as the quantizer would have produced from the bf16 rows.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from megatron_tokenweave.ops.fp8_operands import Fp8Operands
from megatron_tokenweave.ops.fp8_rows import BLOCK_COLS, FP8_DTYPE, Fp8Rows, scale_stride
from megatron_tokenweave.ops.gemm_rows import PaddedRows

# Rows of every woven FP8 GEMM input (per chunk and half): TE's FP8 GEMMs take multiples of 8;
# 16 is the granule Megatron's FP8 inference padding (fp8_utils.prepare_model_for_fp8_inference)
# pads to, so a call the woven layer leaves to the stock path is padded as Megatron pads it.
FP8_ROWS = 16
# A module's PaddedRows of x and of its FP8 weight, kept on it between calls (ops/gemm_rows.py)
_PADDED = "_tokenweave_padded_rows"

try:
    from transformer_engine.pytorch.cpp_extensions import general_gemm  # noqa: I001
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    from transformer_engine.pytorch.module._common import set_quantizer_amax_reduction_group
    from transformer_engine.pytorch.module.base import (
        TransformerEngineBaseModule,
        quantize_weight,
    )
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import (
        Float8TensorStorage,
    )

    import transformer_engine_torch as tex  # after TE's Python package, which loads its library

    _INPUT = int(tex.FP8FwdTensors.GEMM1_INPUT)
    _MISSING: str | None = None
except Exception as exc:  # noqa: BLE001 - no TE, or a TE without these pieces
    TransformerEngineBaseModule = None  # type: ignore[assignment,misc]
    _MISSING = f"{type(exc).__name__}: {exc}"


def missing() -> str | None:
    """Why this TransformerEngine cannot run the woven FP8 GEMMs (None: it can)."""
    return _MISSING


def is_te(module: torch.nn.Module) -> bool:
    """Whether the module is a TE linear whose FP8 GEMMs this module can run."""
    return _MISSING is None and isinstance(module, TransformerEngineBaseModule)


def module_reason(module: torch.nn.Module) -> str | None:
    """Why a linear's FP8 GEMMs are not woven (None: they are)."""
    if not is_te(module):
        return (f"{type(module).__name__} is not a TransformerEngine linear (FP8 GEMMs are "
                f"TE's{'' if _MISSING is None else '; ' + _MISSING})")
    if getattr(module, "te_quant_params", None) is not None:
        return "per-module quantization recipes (te_quant_params) are not woven"
    return None


def active() -> bool:
    """Whether the GEMMs of a TE linear called now are FP8 (inside an enabled FP8 autocast)."""
    return _MISSING is None and FP8GlobalStateManager.is_fp8_enabled()


def autocast_reason() -> str | None:
    """Why the enabled FP8 autocast's recipe is not woven (None: it is one of TE's Hopper
    recipes, delayed, current (tensorwise) or block scaling). Megatron enters the recipe its
    config names, which the layer's structure check has checked; an autocast entered around the
    model may name another."""
    recipe = FP8GlobalStateManager.get_fp8_recipe()
    if recipe.delayed() or recipe.float8_current_scaling() or recipe.float8_block_scaling():
        return None
    return f"the FP8 autocast's recipe {type(recipe).__name__} is not woven"


@contextlib.contextmanager
def _prepared(module: Any, x: torch.Tensor) -> Iterator[None]:
    """The module's FP8 forward preparation, as its own forward does it (TE 2.20:
    prepare_forward + end_forward; earlier: prepare_forward as a context)."""
    ctx = getattr(module, "prepare_forward_ctx", None)
    if ctx is not None:
        with ctx(x):
            yield
        return
    prepared = module.prepare_forward(x)
    if hasattr(prepared, "__enter__"):
        with prepared:
            yield
        return
    try:
        yield
    finally:
        module.end_forward()


def _weight(module: Any, quantizer: Any) -> tuple[Any, bool]:
    """The module's FP8 weight, from its workspace cache under Megatron's rule (TELinear.forward:
    quantized at the first forward, reused after, unless the transpose cache is disabled; a
    module without Megatron's flag is quantized every call, as TE's own forward does then), and
    whether this call may have quantized it anew (under CUDA-graph capture the device-side skip
    flag decides: counted as may)."""
    weight, _ = module._get_weight_and_bias_tensors()
    first = (None if getattr(module, "disable_parameter_transpose_cache", False)
             else getattr(module, "is_first_microbatch", None))  # a plain te.Linear: None
    if hasattr(module, "is_first_microbatch"):
        module.is_first_microbatch = False
    skip = None
    if FP8GlobalStateManager.fp8_graph_capturing():
        skip = FP8GlobalStateManager.quantization_state.skip_fp8_weight_update_tensor
    if skip is not None:
        first = False
    cache = None if first is None else "weight"
    quantizer.set_usage(rowwise=True, columnwise=False)
    if hasattr(module, "_enable_weight_preswizzle"):
        quantizer.optimize_for_gemm = module._enable_weight_preswizzle(quantizer, weight)
    weightmat, new = quantize_weight(
        tensor=weight, quantizer=quantizer,
        workspace=module._fp8_workspaces.get(cache) if cache else None,
        update_workspace=first is None or first, skip_update_flag=skip,
        workspace_dtype=module.activation_dtype, cache=cache is not None)
    if new is not None:
        module._fp8_workspaces[cache] = new.detach() if isinstance(new, torch.Tensor) else new
    weightmat.update_usage(rowwise_usage=True)
    return weightmat, cache is None or first is not False or skip is not None


def fused_quantizer(module: torch.nn.Module) -> Any | None:
    """The module's input quantizer where the fused op before it can write that input in FP8
    (ops.fp8_rows) now: a TE linear whose FP8 state is set up for the enabled autocast's recipe
    (its forward preparation then keeps the quantizer: TE re-initializes only on another
    recipe), quantizing to e4m3 with one known scale (delayed scaling) or 1 x 128 blocks
    (blockwise scaling's activations). None otherwise (current scaling: its scale needs the
    whole call's amax first; or state not yet made, as before a module's first FP8 forward)."""
    if not is_te(module) or not getattr(module, "fp8_initialized", False):
        return None
    recipe, own = FP8GlobalStateManager.get_fp8_recipe(), module.fp8_meta.get("recipe")
    if own is not recipe and own != recipe:
        return None
    quantizers = getattr(module, "quantizers", {}).get("scaling_fwd")
    if not quantizers:
        return None
    q = quantizers[_INPUT]
    if q.dtype != tex.DType.kFloat8E4M3:
        return None
    if type(q) is Float8Quantizer or (type(q) is Float8BlockQuantizer
                                      and q.block_scaling_dim == 1):
        return q
    return None


def written_input(quantizer: Any, data: torch.Tensor, scales: torch.Tensor,
                  dtype: torch.dtype) -> tuple[Fp8Rows, Any]:
    """Where the fused op writes a linear's FP8 input for `quantizer` (fused_quantizer's), and
    that input as TE's quantized storage for the GEMM: e4m3 rows `data` [1, rows, H], their
    scales in the flat fp32 region `scales`; `dtype` the activations' (the storage's nominal
    dtype)."""
    rows, hidden = data.shape[1], data.shape[2]
    if type(quantizer) is Float8Quantizer:
        scale_inv = scales[:1]
        fp8 = Fp8Rows.tensor_scaled(data, quantizer.scale, quantizer.amax, scale_inv)
        storage = Float8TensorStorage(data=data[0].view(torch.uint8), fp8_scale_inv=scale_inv,
                                      fp8_dtype=tex.DType.kFloat8E4M3, quantizer=quantizer,
                                      fake_dtype=dtype)
        return fp8, storage
    shape = (hidden // BLOCK_COLS, scale_stride(rows))
    scale_inv = scales[:shape[0] * shape[1]].view(shape)
    fp8 = Fp8Rows.blockwise(data, scale_inv, amax_eps=quantizer.amax_epsilon,
                            pow2=quantizer.force_pow_2_scales)
    storage = Float8BlockwiseQTensorStorage(
        rowwise_data=data[0].view(torch.uint8), rowwise_scale_inv=scale_inv,
        columnwise_data=None, columnwise_scale_inv=None, fp8_dtype=tex.DType.kFloat8E4M3,
        quantizer=quantizer, is_2D_scaled=False, fake_dtype=dtype)
    return fp8, storage


class Fp8Gemm:
    """A module's FP8 GEMM inside `gemms`' scope: called on (x [rows, in] or an input already
    quantized (written_input), out [rows, out] contiguous, bias [out] or None), TE's GEMM
    computes out = x @ W^T (+ bias); `operands` gives the communicating GEMM (the GEMM-fused
    mechanism) its FP8 inputs instead."""

    def __init__(self, input_q: Any, weight: Any, split_acc: bool,
                 padded: tuple[PaddedRows, PaddedRows], weight_changed: bool) -> None:
        self.input_q, self.weight, self.split_acc = input_q, weight, split_acc
        self.padded = padded  # x's and the weight's, kept on the module
        self.weight_changed = weight_changed  # whether `_weight` may have quantized it anew

    def __call__(self, rows: Any, out: torch.Tensor, bias: torch.Tensor | None) -> None:
        if isinstance(rows, torch.Tensor):
            rows = self.input_q(_granules(rows))
        general_gemm(self.weight, rows, out_dtype=out.dtype, bias=bias,
                     use_split_accumulator=self.split_acc, out=out)

    def operands(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Fp8Operands]:
        """rows [n, in] quantized by the module's input quantizer, and the module's FP8 weight,
        as the communicating GEMM takes them: e4m3 data (in padded rows where theirs start off
        a 32-byte sector: ops/gemm_rows.py) and their scale_inv (per tensor, or TE's GEMM-ready
        blocks)."""
        x, x_scales = _e4m3(self.input_q(_granules(rows)))
        w, w_scales = self._weight_e4m3
        return self.padded[0](x), w, Fp8Operands(
            x_scales, w_scales, blocks=isinstance(self.weight, Float8BlockwiseQTensorStorage))

    @functools.cached_property
    def _weight_e4m3(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 weight's data (padded rows as x's) and scale_inv, taken once for the call's
        halves."""
        w, scales = _e4m3(self.weight)
        return self.padded[1](w, self.weight_changed), scales


def _granules(rows: torch.Tensor) -> torch.Tensor:
    if rows.shape[0] % FP8_ROWS:
        raise ValueError(f"TokenWeave: FP8 GEMMs take multiples of {FP8_ROWS} rows, got "
                         f"{rows.shape[0]}")
    return rows


def _e4m3(storage: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A TE FP8 storage's rowwise e4m3 data and scale_inv (ops/fp8_operands.py's layouts)."""
    fp8_dtype = getattr(storage, "_fp8_dtype", None)  # tex.DType or TE's Python DType
    if str(getattr(fp8_dtype, "name", fp8_dtype)).endswith("kFloat8E4M3"):
        if isinstance(storage, Float8BlockwiseQTensorStorage):
            form = getattr(storage, "_data_format", None)  # TE versions with a compact form
            if form is not None and "GEMM_READY" not in str(form):
                raise RuntimeError(f"TokenWeave: blockwise FP8 data in the {form} form; the "
                                   "communicating GEMM takes TE's GEMM-ready scales")
            return storage._rowwise_data.view(FP8_DTYPE), storage._rowwise_scale_inv
        if isinstance(storage, Float8TensorStorage):
            return storage._data.view(FP8_DTYPE), storage._scale_inv.view(1)
    raise RuntimeError(f"TokenWeave: the communicating GEMM takes e4m3 per-tensor or blockwise "
                       f"FP8 operands, got {type(storage).__name__} ({fp8_dtype})")


@contextlib.contextmanager
def gemms(module: Any, x: torch.Tensor, written_for: Any | None = None) -> Iterator[Fp8Gemm]:
    """Inside the scope, the module's FP8 GEMM on any rows of its input x (`Fp8Gemm`), or on
    an input the fused op wrote already quantized (written_input's storage) for `written_for`,
    the quantizer it was written for, which must be the module's (fused_quantizer's promise)."""
    with _prepared(module, x):
        if not module.fp8:
            raise RuntimeError(f"TokenWeave: {type(module).__name__} is not in FP8 inside an "
                               "enabled FP8 autocast")
        input_q, weight_q, *_ = module._get_quantizers(False, False, False)
        if written_for is not None and written_for is not input_q:
            raise RuntimeError(f"TokenWeave: {type(module).__name__}'s input quantizer changed "
                               "between the fused op that wrote its FP8 input and its GEMM")
        set_quantizer_amax_reduction_group(input_q, None)
        input_q.set_usage(rowwise=True, columnwise=False)
        weight, changed = _weight(module, weight_q)
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        fprop = getattr(recipe, "fp8_gemm_fprop", None)
        padded = module.__dict__.get(_PADDED)
        if padded is None:  # made once per module, not per call
            padded = module.__dict__[_PADDED] = (PaddedRows(), PaddedRows())
        yield Fp8Gemm(input_q, weight, bool(getattr(fprop, "use_split_accumulator", False)),
                      padded, changed)

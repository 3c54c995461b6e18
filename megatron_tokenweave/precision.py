"""The precision of a layer's GEMMs, read from Megatron's TransformerConfig: the activations'
own dtype, or one of TransformerEngine's FP8 / FP4 recipes.

It keys the split tables: FP8 GEMMs run up to about twice as fast as bf16 ones on Hopper (not
measured here), so communication is a larger share of the layer and a table measured with bf16
GEMMs says nothing about the best plan in FP8. It also says, per recipe, why the woven layer
does not run it, so that the refusal names the recipe instead of a blanket "fp8"; every
refused recipe takes the stock TE path, whose FP8 GEMMs, quantizers and checkpoints stay
exactly Megatron's.
"""

from __future__ import annotations

from typing import Any

NATIVE = "native"  # the GEMMs run in the activations' dtype (bf16, fp16, fp32)

# Why no FP8 / FP4 recipe weaves today, and what some recipes add to that (Megatron's Fp8Recipe /
# Fp4Recipe values, megatron.core.enums; a recipe Megatron adds later gets the common reason).
_NOT_WOVEN = ("the woven linears run their GEMMs in the activations' dtype, and TE's FP8 / FP4 "
              "GEMMs and quantizer state (scales, amax histories) live in its modules' own forward")
_RECIPE_NOTES = {
    "mxfp8": "MXFP8 is Blackwell's block-scaled format (sm_100)",
    "custom": "a custom quantizer factory's format is unknown to the fused op",
    "nvfp4": "NVFP4 is Blackwell's format (sm_100)",
}


def _value(field: Any) -> str | None:
    """An enum member's value or a plain string (Megatron takes either), None when unset."""
    if field is None or field is False:
        return None
    return str(getattr(field, "value", field))


def gemm_precision(config: Any) -> str:
    """NATIVE, "fp8-<format>-<recipe>" (e.g. "fp8-e4m3-blockwise") or "fp4-<format>-<recipe>":
    what a split table is measured for besides the activations' dtype."""
    fp8 = _value(getattr(config, "fp8", None))
    if fp8 is not None:
        return f"fp8-{fp8}-{_value(getattr(config, 'fp8_recipe', None)) or 'delayed'}"
    fp4 = _value(getattr(config, "fp4", None))
    if fp4 is not None:
        return f"fp4-{fp4}-{_value(getattr(config, 'fp4_recipe', None)) or 'nvfp4'}"
    return NATIVE


def unwoven_reason(config: Any) -> str | None:
    """Why the woven layer does not run this config's GEMM precision (None: it does)."""
    precision = gemm_precision(config)
    if precision == NATIVE:
        return None
    kind, fmt, recipe = precision.split("-", 2)
    note = _RECIPE_NOTES.get(recipe)
    return (f"{kind.upper()} recipe {recipe!r} ({fmt}) is not woven: {_NOT_WOVEN}"
            + (f"; {note}" if note else ""))

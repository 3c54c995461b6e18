"""The precision of a layer's GEMMs, read from Megatron's TransformerConfig: the activations'
own dtype, or one of TransformerEngine's FP8 / FP4 recipes.

It keys the split tables: FP8 GEMMs run up to about twice as fast as bf16 ones on Hopper (not
measured here), so communication is a larger share of the layer and a table measured with bf16
GEMMs says nothing about the best plan in FP8. It also says, per recipe, whether the woven layer
runs it: the FP8 recipes TE runs on Hopper (delayed, tensorwise, blockwise) weave in the TE
flavour, whose linears then run TE's FP8 GEMMs with their own quantizers
(megatron_tokenweave.fp8_gemm); every other recipe is refused by name and takes the stock TE
path, whose FP8 GEMMs, quantizers and checkpoints stay exactly Megatron's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from megatron_tokenweave import fp8_gemm

NATIVE = "native"  # the GEMMs run in the activations' dtype (bf16, fp16, fp32)

# The recipes TE runs on Hopper (Megatron's Fp8Recipe values): woven with TE's FP8 GEMMs.
WOVEN_FP8_RECIPES = ("delayed", "tensorwise", "blockwise")
# Why the others are not (a recipe Megatron adds later gets the common reason).
_NOT_WOVEN = "the woven linears run TE's FP8 GEMMs for the recipes " + ", ".join(
    WOVEN_FP8_RECIPES) + " only"
_RECIPE_NOTES = {
    "mxfp8": "MXFP8 is Blackwell's block-scaled format (sm_100)",
    "custom": "a custom quantizer factory's format is unknown to the woven layer",
    "nvfp4": "NVFP4 is Blackwell's format (sm_100)",
}


def fp8_fields(recipe: str) -> dict[str, str]:
    """The TransformerConfig fields of one of the woven FP8 recipes in e4m3 ("none": bf16
    GEMMs, no fields): what the benchmarks' --fp8-recipe sets."""
    if recipe == "none":
        return {}
    if recipe not in WOVEN_FP8_RECIPES:
        raise ValueError(f"FP8 recipe must be one of {WOVEN_FP8_RECIPES} or 'none', got {recipe!r}")
    return {"fp8": "e4m3", "fp8_recipe": recipe}


def bench_precision(recipe: str) -> str:
    """What a benchmark row calls the GEMMs' precision for its --fp8-recipe: "bf16" (the
    benchmarks' activations) or gemm_precision's name of the recipe's fields."""
    return "bf16" if recipe == "none" else gemm_precision(_Fields(fp8_fields(recipe)))


class _Fields:
    """Config fields as attributes (what gemm_precision reads)."""

    def __init__(self, fields: dict[str, str]) -> None:
        self.__dict__.update(fields)


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


def unwoven_reason(config: Any, linears: Iterable[torch.nn.Module] = ()) -> str | None:
    """Why the woven layer does not run this config's GEMM precision with these linears (the
    layer's column- and row-parallel ones; None: it does)."""
    precision = gemm_precision(config)
    if precision == NATIVE:
        return None
    kind, fmt, recipe = precision.split("-", 2)
    if kind == "fp8" and recipe in WOVEN_FP8_RECIPES:
        for linear in linears:
            reason = fp8_gemm.module_reason(linear)
            if reason is not None:
                return f"FP8 recipe {recipe!r} ({fmt}) is not woven here: {reason}"
        return None
    note = _RECIPE_NOTES.get(recipe)
    return (f"{kind.upper()} recipe {recipe!r} ({fmt}) is not woven: {_NOT_WOVEN}"
            + (f"; {note}" if note else ""))

"""The GEMMs' precision: read from Megatron's config, keying the split tables; the FP8 recipes TE
runs on Hopper woven where the linears are TE's, every other FP8 / FP4 recipe Megatron offers
refused by name (the stock path runs it)."""

from __future__ import annotations

import json

import pytest
import torch
from _dist import build_model
from megatron.core.enums import Fp4Recipe, Fp8Recipe

from megatron_tokenweave import policy
from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.models import SHAPES
from megatron_tokenweave.policy import SplitPolicy, TableKey
from megatron_tokenweave.precision import (
    NATIVE,
    WOVEN_FP8_RECIPES,
    gemm_precision,
    unwoven_reason,
)

SHAPE = SHAPES["tiny"]


class _Config:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_native_config_weaves():
    assert gemm_precision(_Config()) == NATIVE
    assert unwoven_reason(_Config(fp8=None, fp4=None)) is None


WOVEN = [r for r in Fp8Recipe if r.value in WOVEN_FP8_RECIPES]
REFUSED = [r for r in Fp8Recipe if r.value not in WOVEN_FP8_RECIPES]


def test_the_hopper_recipes_are_the_woven_ones():
    assert {r.value for r in WOVEN} == {"delayed", "tensorwise", "blockwise"}
    assert {r.value for r in REFUSED} == {"mxfp8", "custom"}


@pytest.mark.parametrize("recipe", WOVEN)
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_hopper_recipes_weave_on_te_linears_only(recipe, fmt):
    """Enum member or its string (Megatron takes either): the same precision; woven with no
    linear to refuse it, refused by name with the linear's reason on a non-TE linear."""
    local = torch.nn.Linear(16, 16)
    for given in (recipe, recipe.value):
        cfg = _Config(fp8=fmt, fp8_recipe=given)
        assert gemm_precision(cfg) == f"fp8-{fmt}-{recipe.value}"
        assert unwoven_reason(cfg) is None
        reason = unwoven_reason(cfg, [local])
        assert f"FP8 recipe {recipe.value!r} ({fmt}) is not woven here: Linear is not a " \
            "TransformerEngine linear" in reason


@pytest.mark.parametrize("recipe", REFUSED)
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_every_other_fp8_recipe_is_named_and_refused(recipe, fmt):
    for given in (recipe, recipe.value):
        cfg = _Config(fp8=fmt, fp8_recipe=given)
        assert gemm_precision(cfg) == f"fp8-{fmt}-{recipe.value}"
        reason = unwoven_reason(cfg)
        assert f"FP8 recipe {recipe.value!r} ({fmt}) is not woven: the woven linears run " \
            "TE's FP8 GEMMs for the recipes delayed, tensorwise, blockwise only" in reason


@pytest.mark.parametrize("recipe", list(Fp4Recipe))
def test_every_fp4_recipe_is_named_and_refused(recipe):
    cfg = _Config(fp4="e2m1", fp4_recipe=recipe)
    assert gemm_precision(cfg) == f"fp4-e2m1-{recipe.value}"
    assert f"FP4 recipe {recipe.value!r} (e2m1) is not woven" in unwoven_reason(cfg)


def test_fp8_without_a_recipe_is_megatrons_default():
    assert gemm_precision(_Config(fp8="e4m3")) == "fp8-e4m3-delayed"


def test_precision_is_part_of_the_table_key_and_file_name():
    native = TableKey("NVIDIA H200", 2, 8192, "bfloat16", False)
    fp8 = TableKey("NVIDIA H200", 2, 8192, "bfloat16", False, precision="fp8-e4m3-blockwise")
    assert native.precision == NATIVE and native != fp8
    assert native.file_name() == "h200_tp2_h8192_bfloat16_replicated.json"
    assert fp8.file_name() == "h200_tp2_h8192_bfloat16_fp8-e4m3-blockwise_replicated.json"


def _table(key: TableKey, split_from: int) -> dict:
    fields = {"gpu": key.gpu, "tp": key.tp, "hidden": key.hidden, "dtype": key.dtype,
              "sequence_parallel": key.sequence_parallel, "moe": key.moe,
              "cuda_graphs": key.cuda_graphs}
    if key.precision != NATIVE:
        fields["precision"] = key.precision
    return {**fields, "entries": [{"min_tokens": 0, "split": False},
                                  {"min_tokens": split_from, "split": True}]}


def test_an_fp8_model_never_reads_a_native_table(tmp_path, monkeypatch):
    """A bf16 table (no "precision" field, as the shipped ones) serves bf16 GEMMs only; the FP8
    key finds its own table, and without one the config's defaults."""
    monkeypatch.setattr(policy, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(policy, "SHIPPED_TABLES", tmp_path / "none")
    (tmp_path / "tuning").mkdir()
    native = TableKey("NVIDIA H200", 2, 8192, "bfloat16", False)
    fp8 = TableKey("NVIDIA H200", 2, 8192, "bfloat16", False, precision="fp8-e4m3-tensorwise")
    (tmp_path / "tuning" / native.file_name()).write_text(json.dumps(_table(native, 100)))
    cfg = TokenWeaveConfig()
    assert SplitPolicy(cfg, native).plan(100).split
    assert SplitPolicy(cfg, fp8).entries == []
    (tmp_path / "tuning" / fp8.file_name()).write_text(json.dumps(_table(fp8, 5000)))
    fp8_policy = SplitPolicy(cfg, fp8)
    assert not fp8_policy.plan(100).split and fp8_policy.plan(5000).split
    assert SplitPolicy(cfg, native).plan(100).split


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_woven_layer_with_an_fp8_config_gives_the_recipes_reason(single_rank_group, recipe):
    """The local flavour (what CPU machines build): the structure check returns the recipe's
    refusal naming the linear that has no FP8 GEMMs (the stock path then runs, logged once per
    reason), not a generic one."""
    model = build_model("tokenweave", SHAPE, 2, 1, fp8="e4m3", fp8_recipe=recipe)
    layer = model.decoder.layers[0]
    reason = layer._check_structure()
    assert reason.startswith(f"FP8 recipe {recipe!r} (e4m3) is not woven here: "
                             "WovenColumnParallelLinear is not a TransformerEngine linear (FP8 "
                             "GEMMs are TE's")
    assert layer._gemm_precision == f"fp8-e4m3-{recipe}"  # the split table's key, from Megatron's
    # config (not the TokenWeaveConfig)


def test_benchmark_fp8_fields_name_a_woven_recipe():
    from megatron_tokenweave.precision import bench_precision, fp8_fields

    assert fp8_fields("none") == {} and bench_precision("none") == "bf16"
    for recipe in WOVEN_FP8_RECIPES:
        fields = fp8_fields(recipe)
        assert fields == {"fp8": "e4m3", "fp8_recipe": recipe}
        assert gemm_precision(_Config(**fields)) == f"fp8-e4m3-{recipe}"
        assert bench_precision(recipe) == f"fp8-e4m3-{recipe}"
    with pytest.raises(ValueError, match="'mxfp8'"):
        fp8_fields("mxfp8")

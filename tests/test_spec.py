"""The TokenWeave specs: substitutions, checkpoint keys, module-level spec attributes, the
WeaveChain of a block, and loading TE-style norm keys. In-process, TP=1 (1-rank gloo group)."""

from __future__ import annotations

import functools

import pytest
import torch
from _dist import build_model
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_layer import TransformerLayer

import megatron_tokenweave
from megatron_tokenweave import spec as spec_mod
from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.layer import TokenWeaveTransformerLayer
from megatron_tokenweave.linears import WovenColumnParallelLinear, WovenRowParallelLinear
from megatron_tokenweave.models import SHAPES
from megatron_tokenweave.norm import TokenWeaveNorm
from megatron_tokenweave.spec import (
    NORM_KEYS_MAP,
    get_gpt_decoder_block_tokenweave_spec,
    get_gpt_layer_tokenweave_spec,
)

SHAPE = SHAPES["tiny"]


def _stock():
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def test_layer_spec_substitutes_layer_norms_and_linears():
    spec = get_gpt_layer_tokenweave_spec(False, normalization="RMSNorm")
    sub = spec.submodules
    assert spec.module is TokenWeaveTransformerLayer
    assert sub.input_layernorm is TokenWeaveNorm and sub.pre_mlp_layernorm is TokenWeaveNorm
    attn = sub.self_attention.submodules
    assert attn.linear_qkv is WovenColumnParallelLinear
    assert attn.linear_proj is WovenRowParallelLinear
    assert isinstance(sub.mlp, functools.partial)
    mlp = sub.mlp.keywords["submodules"]
    assert mlp.linear_fc1 is WovenColumnParallelLinear
    assert mlp.linear_fc2 is WovenRowParallelLinear


def test_layer_spec_keeps_everything_else_stock():
    """Attention core, q/k norms, bias-dropout-adds, cross-attention, activation and the MLP
    builder are exactly what the stock local spec has."""
    ours, stock = get_gpt_layer_tokenweave_spec(False, normalization="RMSNorm").submodules, _stock()
    stock = stock.submodules
    for name in ("self_attn_bda", "mlp_bda", "cross_attention", "cross_attn_bda",
                 "pre_cross_attn_layernorm"):
        assert getattr(ours, name) is getattr(stock, name), name
    assert ours.self_attention.module is stock.self_attention.module
    assert ours.self_attention.params == stock.self_attention.params
    for name in ("core_attention", "q_layernorm", "k_layernorm"):
        assert getattr(ours.self_attention.submodules, name) is getattr(
            stock.self_attention.submodules, name), name
    assert ours.mlp.func == stock.mlp.func
    ours_mlp, stock_mlp = ours.mlp.keywords["submodules"], stock.mlp.keywords["submodules"]
    assert ours_mlp.activation_func is stock_mlp.activation_func


def test_layer_spec_keeps_stock_sharded_state_dict_keys_map():
    ours = get_gpt_layer_tokenweave_spec(False, normalization="RMSNorm")
    keys_map = ours.submodules.sharded_state_dict_keys_map
    for key, value in _stock().submodules.sharded_state_dict_keys_map.items():
        assert keys_map[key] == value
    for key, value in NORM_KEYS_MAP.items():
        assert keys_map[key] == value


def test_layer_spec_passes_tokenweave_config():
    cfg = TokenWeaveConfig(split_threshold=3)
    assert get_gpt_layer_tokenweave_spec(False, cfg).params["tokenweave_config"] is cfg


def test_module_level_specs_resolve_to_local_on_cpu():
    """`tokenweave_spec` and `tokenweave_local_spec` resolve, from the spec module and the
    package; without TransformerEngine `tokenweave_spec` is the local flavour."""
    assert not spec_mod.te_available()
    for name in ("tokenweave_spec", "tokenweave_local_spec"):
        for owner in (spec_mod, megatron_tokenweave):
            resolved = getattr(owner, name)
            assert resolved.module is TokenWeaveTransformerLayer, (owner, name)
            linear = resolved.submodules.self_attention.submodules.linear_qkv
            assert linear is WovenColumnParallelLinear, (owner, name)
            assert resolved.submodules.input_layernorm is TokenWeaveNorm


def test_te_spec_without_transformer_engine_raises_import_error():
    with pytest.raises(ImportError, match="TransformerEngine"):
        get_gpt_layer_tokenweave_spec(True)


@pytest.mark.parametrize("owner", [spec_mod, megatron_tokenweave], ids=["spec", "package"])
def test_unknown_attribute_raises_attribute_error(owner):
    with pytest.raises(AttributeError, match="tokenweave_nope"):
        owner.tokenweave_nope  # noqa: B018


def _shape(value):
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)


def test_state_dict_keys_equal_stock(single_rank_group):
    """A 2-layer tokenweave GPTModel has exactly the stock local GPTModel's state_dict keys and
    shapes, and the stock state_dict loads into it with strict=True."""
    stock = build_model("stock", SHAPE, 2, 1)
    woven = build_model("tokenweave", SHAPE, 2, 1)
    stock_sd, woven_sd = stock.state_dict(), woven.state_dict()
    assert list(woven_sd) == list(stock_sd)
    assert {k: _shape(v) for k, v in woven_sd.items()} == {
        k: _shape(v) for k, v in stock_sd.items()}
    woven.load_state_dict(stock_sd, strict=True)


def test_built_model_uses_tokenweave_modules(single_rank_group):
    woven = build_model("tokenweave", SHAPE, 2, 1)
    for layer in woven.decoder.layers:
        assert type(layer) is TokenWeaveTransformerLayer and isinstance(layer, TransformerLayer)
        assert type(layer.input_layernorm) is torch.nn.RMSNorm
        assert type(layer.pre_mlp_layernorm) is torch.nn.RMSNorm
        assert type(layer.self_attention.linear_qkv) is WovenColumnParallelLinear
        assert type(layer.self_attention.linear_proj) is WovenRowParallelLinear
        assert type(layer.mlp.linear_fc1) is WovenColumnParallelLinear
        assert type(layer.mlp.linear_fc2) is WovenRowParallelLinear


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_layers_of_one_block_share_one_chain(single_rank_group, num_layers):
    """All layers of a block are in one WeaveChain; layer i's successor is layer i + 1 and the
    last has none. A second model gets its own chain."""
    model = build_model("tokenweave", SHAPE, num_layers, 1)
    layers = list(model.decoder.layers)
    chain = layers[0]._chain
    assert all(layer._chain is chain for layer in layers)
    for layer, nxt in zip(layers[:-1], layers[1:], strict=True):
        assert chain.successor(layer) is nxt
    assert chain.successor(layers[-1]) is None
    other = build_model("tokenweave", SHAPE, num_layers, 1)
    assert other.decoder.layers[0]._chain is not chain


def test_block_spec_chains_layers_and_has_final_norm(single_rank_group):
    from megatron_tokenweave.models import llama_config

    config = llama_config(SHAPE, 3, 1)
    block = get_gpt_decoder_block_tokenweave_spec(config, False)
    assert len(block.layer_specs) == 3
    assert all(s.module is TokenWeaveTransformerLayer for s in block.layer_specs)
    assert block.layer_norm is TokenWeaveNorm
    model = build_model("tokenweave_block", SHAPE, 3, 1)
    layers = list(model.decoder.layers)
    assert [layers[0]._chain.successor(x) for x in layers] == [layers[1], layers[2], None]
    assert type(model.decoder.final_layernorm) is torch.nn.RMSNorm


def test_te_style_norm_keys_load_into_tokenweave_layer(single_rank_group):
    """TE-spec keys self_attention.linear_qkv.layer_norm_weight / mlp.linear_fc1.layer_norm_weight
    load into input_layernorm.weight / pre_mlp_layernorm.weight (strict)."""
    layer = build_model("tokenweave", SHAPE, 1, 1).decoder.layers[0]
    sd = layer.state_dict()
    gen = torch.Generator().manual_seed(2)
    qkv_norm = 1.0 + torch.randn(SHAPE.hidden, generator=gen)
    fc1_norm = 1.0 + torch.randn(SHAPE.hidden, generator=gen)
    del sd["input_layernorm.weight"], sd["pre_mlp_layernorm.weight"]
    sd["self_attention.linear_qkv.layer_norm_weight"] = qkv_norm
    sd["mlp.linear_fc1.layer_norm_weight"] = fc1_norm
    layer.load_state_dict(sd, strict=True)
    assert torch.equal(layer.input_layernorm.weight.detach(), qkv_norm)
    assert torch.equal(layer.pre_mlp_layernorm.weight.detach(), fc1_norm)


class _NormWithExtraState(torch.nn.RMSNorm):
    """Like TE's RMSNorm: a norm whose state dict carries an `_extra_state` entry."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object):
        super().__init__(hidden_size, eps=eps)
        self.extra = torch.tensor([7], dtype=torch.uint8)

    def get_extra_state(self) -> torch.Tensor:
        return self.extra.clone()

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.extra = state.clone()


def test_te_style_state_dict_loads_into_norms_with_extra_state(single_rank_group):
    """A TE-spec state dict (norm weights inside the fused linears, so no norm `_extra_state`)
    loads strictly into a layer whose separate norms carry extra state, as TE's do; the norms
    keep their own extra state. A state dict that has the norm keys loads them as given."""
    import dataclasses

    from megatron_tokenweave.models import build_gpt, llama_config

    layer_spec = get_gpt_layer_tokenweave_spec(False)
    sub = dataclasses.replace(layer_spec.submodules, input_layernorm=_NormWithExtraState,
                              pre_mlp_layernorm=_NormWithExtraState)
    model = build_gpt(llama_config(SHAPE, 1, 1), dataclasses.replace(layer_spec, submodules=sub),
                      SHAPE.vocab, 64)
    layer = model.decoder.layers[0]
    sd = layer.state_dict()
    assert "input_layernorm._extra_state" in sd
    weight = 1.0 + torch.randn(SHAPE.hidden, generator=torch.Generator().manual_seed(3))
    for ours, theirs in (("input_layernorm", "self_attention.linear_qkv"),
                         ("pre_mlp_layernorm", "mlp.linear_fc1")):
        del sd[f"{ours}._extra_state"]
        sd[f"{theirs}.layer_norm_weight"] = sd.pop(f"{ours}.weight")
    sd["self_attention.linear_qkv.layer_norm_weight"] = weight
    layer.load_state_dict(sd, strict=True)
    assert torch.equal(layer.input_layernorm.weight.detach(), weight)
    assert layer.input_layernorm.extra.tolist() == [7]
    given = layer.state_dict()
    given["pre_mlp_layernorm._extra_state"] = torch.tensor([9], dtype=torch.uint8)
    layer.load_state_dict(given, strict=True)
    assert layer.pre_mlp_layernorm.extra.tolist() == [9]


def test_hybrid_stack_spec_substitutes_by_layer_type():
    """The TokenWeave hybrid stack spec (local flavour without TE): each woven layer type gets
    its woven layer class, its norm as a module of its own (TokenWeaveNorm), a plain woven
    column linear where Megatron has the fused-norm linear and the woven row linear; the DSA,
    MLA and MTP specs stay Megatron's."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    from megatron_tokenweave import layer as layer_mod
    from megatron_tokenweave.hybrid import TokenWeaveHybridStack, get_hybrid_stack_tokenweave_spec

    cfg = TokenWeaveConfig(split_threshold=5)
    spec = get_hybrid_stack_tokenweave_spec(False, cfg)
    sub, stock = spec.submodules, hybrid_stack_spec.submodules
    assert spec.module is TokenWeaveHybridStack and spec.params["final_norm"] is TokenWeaveNorm
    woven = {
        "attention_layer": (layer_mod.TokenWeaveTransformerLayer, "input_layernorm",
                            "self_attention", "linear_qkv", "linear_proj"),
        "mlp_layer": (layer_mod.TokenWeaveMLPLayer, "pre_mlp_layernorm", "mlp", "linear_fc1",
                      "linear_fc2"),
        "mamba_layer": (layer_mod.TokenWeaveMambaLayer, "norm", "mixer", "in_proj", "out_proj"),
        "gdn_layer": (layer_mod.TokenWeaveTransformerLayer, "input_layernorm", "self_attention",
                      "in_proj", "out_proj"),
    }
    for name, (cls, norm, mixer, column, row) in woven.items():
        layer = getattr(sub, name)
        assert layer.module is cls and layer.params["tokenweave_config"] is cfg, name
        assert getattr(layer.submodules, norm) is TokenWeaveNorm, name
        mixer_spec = getattr(layer.submodules, mixer)
        mixer_sub = (mixer_spec.keywords["submodules"] if isinstance(mixer_spec, functools.partial)
                     else mixer_spec.submodules)
        assert getattr(mixer_sub, column) is WovenColumnParallelLinear, name
        assert getattr(mixer_sub, row) is WovenRowParallelLinear, name
        keys = layer.submodules.sharded_state_dict_keys_map
        assert keys[f"{norm}."] == f"{mixer}.{column}.layer_norm_", name
        stock_mixer = getattr(getattr(stock, name).submodules, mixer)
        if not isinstance(mixer_spec, functools.partial):
            assert mixer_spec.module is stock_mixer.module and \
                mixer_spec.params == stock_mixer.params, name
    moe = sub.moe_layer
    assert moe.module is layer_mod.TokenWeaveMoETransformerLayer
    assert moe.submodules.pre_mlp_layernorm is TokenWeaveNorm
    for name in ("dsa_layer", "mla_layer", "mtp_block_spec"):
        assert getattr(sub, name) is getattr(stock, name), name


def test_megatron_lm_hybrid_spec_route_resolves():
    """Megatron-LM's hybrid entry point imports `--spec <module> <name>` as its
    hybrid_stack_spec: `megatron_tokenweave.spec tokenweave_hybrid_stack_spec` resolves (the
    local flavour without TE), as do the package attribute and the explicit local flavour."""
    from megatron.core.transformer.spec_utils import import_module

    from megatron_tokenweave.hybrid import TokenWeaveHybridStack

    resolved = import_module(["megatron_tokenweave.spec", "tokenweave_hybrid_stack_spec"])
    assert resolved.module is TokenWeaveHybridStack
    assert resolved.submodules.attention_layer.submodules.input_layernorm is TokenWeaveNorm
    assert megatron_tokenweave.tokenweave_hybrid_stack_spec is resolved
    assert spec_mod.tokenweave_hybrid_local_stack_spec.module is TokenWeaveHybridStack
    with pytest.raises(ImportError, match="TransformerEngine"):
        megatron_tokenweave.get_hybrid_stack_tokenweave_spec(True)
    with pytest.raises(ImportError, match="TransformerEngine"):
        spec_mod.tokenweave_hybrid_te_stack_spec  # noqa: B018


def test_megatron_lm_gpt_spec_route_resolves():
    """Megatron-LM's GPT entry point reads `--spec megatron_tokenweave.spec tokenweave_spec` the
    same way (`vars(module)[name]`, which a lazily built attribute would not satisfy)."""
    from megatron.core.transformer.spec_utils import import_module

    for name in ("tokenweave_spec", "tokenweave_local_spec"):
        resolved = import_module(["megatron_tokenweave.spec", name])
        assert resolved is getattr(spec_mod, name)
        assert resolved.module is TokenWeaveTransformerLayer

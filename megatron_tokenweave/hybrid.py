"""HybridModel with TokenWeave: the hybrid stack spec, and the stack class it names.

Megatron's `hybrid_stack_spec` (megatron.core.models.hybrid.hybrid_layer_specs) is TE-only: its
norms live inside `TELayerNormColumnParallelLinear`s. The TokenWeave spec takes it apart, by
layer type, the way the GPT spec does: the norm becomes the layer's own module (which the fused
op of the layer before applies), the fused-norm linear a plain column-parallel linear, the
row-parallel linear the woven one, and the layer class its woven counterpart
(layer.WOVEN_LAYERS). Parameters, state-dict keys and sharded keys stay Megatron's (the
sharded_state_dict_keys_map puts each norm back under the fused linear's name).

    *  attention   TransformerLayer         input_layernorm    linear_qkv / linear_proj
    -  MLP         MLPLayer                 pre_mlp_layernorm  linear_fc1 / linear_fc2
    E  MoE         MoETransformerLayer      pre_mlp_layernorm  (experts: Megatron's MoE spec)
    M  Mamba-2     MambaLayer               norm               mixer.in_proj / out_proj
    G  GDN         TransformerLayer         input_layernorm    in_proj / out_proj
    D, +  DSA/MLA  Megatron's stock layers (their attention has other linears: not woven)

One set of substitutions builds both flavours of the TokenWeave spec and, with Megatron's own
local modules and layer classes, `local_hybrid_stack_spec()`: the stock hybrid stack on local
modules that Megatron does not ship ("Hybrid always uses TransformerEngine"), against which the
CPU tests compare (and which is itself checked against Megatron's GPTModel local spec).

Megatron-LM: `--spec megatron_tokenweave.spec tokenweave_hybrid_stack_spec` (the hybrid entry
point reads `--spec` as its `hybrid_stack_spec`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.core.extensions.transformer_engine import TENorm
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_tokenweave import linears
from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.layer import WOVEN_LAYERS, WovenLayer, seal_chain
from megatron_tokenweave.log import log_once
from megatron_tokenweave.norm import TokenWeaveNorm

_SYMBOL_NAMES = {Symbols.ATTENTION: "attention", Symbols.MLP: "MLP", Symbols.MOE: "MoE",
                 Symbols.MAMBA: "Mamba", Symbols.GDN: "GDN", Symbols.DS_ATTENTION: "DSA",
                 Symbols.MLA: "MLA"}


class TokenWeaveHybridStack(HybridStack):
    """Megatron's HybridStack with two changes: the final norm is `final_norm` (Megatron builds
    TENorm whatever the spec, which the local flavour cannot use), and no woven hand-off
    crosses the stack's end (a pipeline stage's last layer adds without a norm and joins). A
    TokenWeave stack says once which of the pattern's layers run Megatron's stock layer."""

    def __init__(self, config: Any, submodules: HybridStackSubmodules, pre_process: bool = True,
                 layer_type_list: list[str] | None = None, pp_layer_offset: int = 0,
                 post_layer_norm: bool = True, post_process: bool = True, *args: Any,
                 final_norm: type = TENorm, **kwargs: Any) -> None:
        super().__init__(config, submodules, pre_process, layer_type_list, pp_layer_offset,
                         False, post_process, *args, **kwargs)
        self.post_layer_norm = post_layer_norm
        if post_process and post_layer_norm:
            self.final_norm = final_norm(config=config, hidden_size=config.hidden_size,
                                         eps=config.layernorm_epsilon)
        seal_chain(config)
        if not any(isinstance(layer, WovenLayer) for layer in self.layers):
            return  # a stock stack (local_hybrid_stack_spec)
        for symbol, layer in zip(self.layer_type_list, self.layers, strict=True):
            if not isinstance(layer, WovenLayer):
                log_once(f"hybrid-stock:{symbol}",
                         f"TokenWeave: hybrid '{symbol}' layers ({_SYMBOL_NAMES.get(symbol)}) run "
                         f"Megatron's stock {type(layer).__name__}: TokenWeave weaves '*', '-', "
                         "'E', 'M' and 'G' layers")


@dataclass(frozen=True)
class Modules:
    """The module classes one flavour of the hybrid stack is built from."""

    norm: type  # every norm of a layer, and the stack's final norm
    column: type  # the linear after a norm (in place of TELayerNormColumnParallelLinear)
    row: type
    core_attention: type
    moe: Any  # the 'E' layer's MoE builder
    layers: Mapping[type, type]  # Megatron's layer class -> the class built


def _te_modules(woven: bool) -> Modules:
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.models.hybrid import hybrid_layer_specs

    return Modules(TENorm, linears.WovenTEColumnParallelLinear, linears.WovenTERowParallelLinear,
                   TEDotProductAttention, hybrid_layer_specs.moe, WOVEN_LAYERS if woven else {})


def _local_modules(woven: bool) -> Modules:
    local = LocalSpecProvider()
    moe = get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False)
    if woven:
        return Modules(TokenWeaveNorm, linears.WovenColumnParallelLinear,
                       linears.WovenRowParallelLinear, local.core_attention(), moe, WOVEN_LAYERS)
    return Modules(local.layer_norm(rms_norm=True, for_qk=False), local.column_parallel_linear(),
                   local.row_parallel_linear(), local.core_attention(), moe, {})


def _with_submodules(spec: Any, **changes: Any) -> Any:
    """A mixer spec (a ModuleSpec, or a partial of MLP.as_mlp_submodule) with its submodules'
    fields changed."""
    if isinstance(spec, functools.partial):
        sub = dataclasses.replace(spec.keywords["submodules"], **changes)
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": sub})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes))


def _unfused(layer: ModuleSpec, m: Modules, norm: str, mixer: str, column: str, row: str,
             **mixer_changes: Any) -> ModuleSpec:
    """A stock hybrid layer spec with its fused norm + column linear taken apart: the layer's
    `norm` field gets the norm, the mixer's `column` / `row` fields the linears, and the
    sharded keys of the norm stay under the fused linear's name."""
    sub = layer.submodules
    mixer_spec = _with_submodules(getattr(sub, mixer), **{column: m.column, row: m.row},
                                  **mixer_changes)
    keys = {**sub.sharded_state_dict_keys_map, f"{norm}.": f"{mixer}.{column}.layer_norm_"}
    sub = dataclasses.replace(sub, **{norm: m.norm, mixer: mixer_spec},
                              sharded_state_dict_keys_map=keys)
    return dataclasses.replace(layer, module=m.layers.get(layer.module, layer.module),
                               submodules=sub)


def hybrid_stack_spec_of(m: Modules) -> ModuleSpec:
    """Megatron's hybrid_stack_spec built from the modules `m`."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    stock = hybrid_stack_spec.submodules
    moe_layer = dataclasses.replace(
        stock.moe_layer, module=m.layers.get(stock.moe_layer.module, stock.moe_layer.module),
        submodules=dataclasses.replace(stock.moe_layer.submodules, pre_mlp_layernorm=m.norm,
                                       mlp=m.moe))
    submodules = dataclasses.replace(
        stock,
        attention_layer=_unfused(stock.attention_layer, m, "input_layernorm", "self_attention",
                                 "linear_qkv", "linear_proj", core_attention=m.core_attention),
        mlp_layer=_unfused(stock.mlp_layer, m, "pre_mlp_layernorm", "mlp", "linear_fc1",
                           "linear_fc2"),
        moe_layer=moe_layer,
        mamba_layer=_unfused(stock.mamba_layer, m, "norm", "mixer", "in_proj", "out_proj"),
        gdn_layer=_unfused(stock.gdn_layer, m, "input_layernorm", "self_attention", "in_proj",
                           "out_proj", out_norm=m.norm),
    )
    return ModuleSpec(module=TokenWeaveHybridStack, submodules=submodules,
                      params={"final_norm": m.norm})


def get_hybrid_stack_tokenweave_spec(
    use_transformer_engine: bool | None = None,
    tokenweave_config: TokenWeaveConfig | None = None,
) -> ModuleSpec:
    """The TokenWeave hybrid stack spec: `HybridModel(config, <this>, ...,
    hybrid_layer_pattern=...)` in place of Megatron's `hybrid_stack_spec`. TE flavour when
    TransformerEngine imports (default), else local. tokenweave_config defaults to
    `TokenWeaveConfig()`, overridden by TOKENWEAVE_* environment variables."""
    if use_transformer_engine is None:
        use_transformer_engine = linears.te_available()
    if use_transformer_engine and not linears.te_available():
        raise ImportError("use_transformer_engine=True but TransformerEngine does not import")
    m = _te_modules(True) if use_transformer_engine else _local_modules(True)
    spec = hybrid_stack_spec_of(m)
    sub = spec.submodules
    woven = {name: getattr(sub, name) for name in
             ("attention_layer", "mlp_layer", "moe_layer", "mamba_layer", "gdn_layer")}
    for name, layer in woven.items():
        woven[name] = dataclasses.replace(
            layer, params={**layer.params, "tokenweave_config": tokenweave_config})
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, **woven))


def local_hybrid_stack_spec() -> ModuleSpec:
    """Megatron's hybrid stack on Megatron's local modules (its LocalSpecProvider's norm,
    linears and attention core; its layer classes): the stock side of comparisons where TE does
    not import. Only the final norm's class differs from what HybridStack builds (TENorm)."""
    return hybrid_stack_spec_of(_local_modules(False))


def gpt_to_hybrid_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A GPTModel state dict as the HybridModel of the same decoder holds it: GPT layer i's
    attention (its input norm included) is hybrid layer 2i, its MLP or MoE (with its pre-MLP
    norm) hybrid layer 2i + 1, so the pattern is `*-` (or `*E`) once per GPT layer; the final
    norm is `final_norm`. Embeddings, output layer and every other key stay. Works for the TE
    and the local spec (TE's fused norms sit under their linears, which move with them)."""
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        name = key
        if key.startswith("decoder.layers."):
            _, _, index, rest = key.split(".", 3)
            second = rest.startswith(("pre_mlp_layernorm.", "mlp."))
            name = f"decoder.layers.{2 * int(index) + second}.{rest}"
        elif key.startswith("decoder.final_layernorm."):
            name = "decoder.final_norm." + key.removeprefix("decoder.final_layernorm.")
        out[name] = value
    return out

"""Specs: Megatron's own GPT layer spec (TE or local) with the TokenWeave substitutions, and the
ready specs Megatron-LM's `--spec` names (GPT layers here, hybrid stacks from
megatron_tokenweave.hybrid).

Specs are data: we take the stock spec and replace, by name, the layer class, the two norms and
the four tensor-parallel linears. Everything else (attention core, activation, bias-dropout-add,
q/k norms, MoE) stays what Megatron chose. Usable as
`GPTModel(transformer_layer_spec=tokenweave_spec)` and from Megatron-LM as
`--spec megatron_tokenweave.spec tokenweave_spec`; a HybridModel takes
`tokenweave_hybrid_stack_spec` (`--spec megatron_tokenweave.spec tokenweave_hybrid_stack_spec`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from megatron_tokenweave import linears
from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.hybrid import get_hybrid_stack_tokenweave_spec
from megatron_tokenweave.layer import WOVEN_LAYERS
from megatron_tokenweave.linears import te_available
from megatron_tokenweave.norm import TokenWeaveNorm

# Stock checkpoints name the norms after the TE linears they are fused into; keep those keys.
NORM_KEYS_MAP = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def _replace_submodules(spec: ModuleSpec, **changes: Any) -> ModuleSpec:
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes))


def _replace_mlp(mlp: Any, column: type, row: type) -> Any:
    """Swap fc1/fc2 of a dense MLP spec (a partial of MLP.as_mlp_submodule); leave MoE as is."""
    if not isinstance(mlp, functools.partial) or "submodules" not in mlp.keywords:
        return mlp
    sub = mlp.keywords["submodules"]
    if not hasattr(sub, "linear_fc1") or not hasattr(sub, "linear_fc2"):
        return mlp
    sub = dataclasses.replace(sub, linear_fc1=column, linear_fc2=row)
    return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": sub})


def get_gpt_layer_tokenweave_spec(
    use_transformer_engine: bool | None = None,
    tokenweave_config: TokenWeaveConfig | None = None,
    **stock_kwargs: Any,
) -> ModuleSpec:
    """The TokenWeave layer spec on top of Megatron's TE spec (when TE imports) or local spec.

    stock_kwargs go to Megatron's `get_gpt_layer_with_transformer_engine_spec` /
    `get_gpt_layer_local_spec` (num_experts, qk_layernorm, ...). tokenweave_config defaults to
    `TokenWeaveConfig()`, overridden by TOKENWEAVE_* environment variables.
    """
    if use_transformer_engine is None:
        use_transformer_engine = te_available()
    if use_transformer_engine:
        if not te_available():
            raise ImportError("use_transformer_engine=True but TransformerEngine does not import")
        from megatron.core.extensions.transformer_engine import TENorm

        stock = get_gpt_layer_with_transformer_engine_spec(**stock_kwargs)
        norm, column, row = (
            TENorm,
            linears.WovenTEColumnParallelLinear,
            linears.WovenTERowParallelLinear,
        )
    else:
        stock = get_gpt_layer_local_spec(**stock_kwargs)
        norm, column, row = (
            TokenWeaveNorm,
            linears.WovenColumnParallelLinear,
            linears.WovenRowParallelLinear,
        )
    sub = stock.submodules
    attention = _replace_submodules(sub.self_attention, linear_qkv=column, linear_proj=row)
    layer = _replace_submodules(
        stock,
        input_layernorm=norm,
        pre_mlp_layernorm=norm,
        self_attention=attention,
        mlp=_replace_mlp(sub.mlp, column, row),
        sharded_state_dict_keys_map={**sub.sharded_state_dict_keys_map, **NORM_KEYS_MAP},
    )
    if stock.module not in WOVEN_LAYERS:
        raise TypeError(f"Megatron's spec builds {stock.module.__name__}, which has no woven "
                        "counterpart")
    return dataclasses.replace(
        layer,
        module=WOVEN_LAYERS[stock.module],
        params={**layer.params, "tokenweave_config": tokenweave_config},
    )


def get_gpt_decoder_block_tokenweave_spec(
    config: TransformerConfig,
    use_transformer_engine: bool | None = None,
    tokenweave_config: TokenWeaveConfig | None = None,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    **stock_kwargs: Any,
) -> TransformerBlockSubmodules:
    """A block spec: TokenWeave layers plus a final norm that accepts sequence parallelism.

    Needed only for the local (non-TE) flavour with `sequence_parallel=True`: given a layer
    spec, Megatron builds the block's final norm with WrappedTorchNorm, which refuses sequence
    parallelism. With TE the layer spec alone is enough. Where TE imports, the final norm is
    TENorm as Megatron builds it for any layer spec, so stock checkpoints (whose final norm
    carries TE's extra state) load with strict=True.
    """
    if use_transformer_engine is None:
        use_transformer_engine = te_available()
    layer = get_gpt_layer_tokenweave_spec(use_transformer_engine, tokenweave_config, **stock_kwargs)
    norm = layer.submodules.input_layernorm
    if te_available():
        from megatron.core.extensions.transformer_engine import TENorm

        norm = TENorm
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage, pp_rank), layer_norm=norm
    )


# Ready specs, module attributes because Megatron-LM's `--spec <module> <name>` reads the
# module's namespace (`vars(module)[name]`): TE flavour where TransformerEngine imports, else
# local; the explicitly TE ones only where it imports.
tokenweave_spec = get_gpt_layer_tokenweave_spec()
tokenweave_local_spec = get_gpt_layer_tokenweave_spec(False)
tokenweave_hybrid_stack_spec = get_hybrid_stack_tokenweave_spec()
tokenweave_hybrid_local_stack_spec = get_hybrid_stack_tokenweave_spec(False)
if te_available():
    tokenweave_te_spec = get_gpt_layer_tokenweave_spec(True)
    tokenweave_hybrid_te_stack_spec = get_hybrid_stack_tokenweave_spec(True)


def __getattr__(name: str) -> ModuleSpec:
    if name in ("tokenweave_te_spec", "tokenweave_hybrid_te_stack_spec"):
        raise ImportError(f"{name} needs TransformerEngine, which does not import here")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

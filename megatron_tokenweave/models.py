"""Llama-shaped models with random weights, for tests, examples and benchmarks: GPTModel (a
decoder of attention + MLP layers) and Megatron's HybridModel (a stack of single-mixer layers
described by a pattern: `*-*-` is the same decoder as a 2-layer GPTModel)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec


@dataclass(frozen=True)
class Shape:
    """A decoder's shape: Llama-style (RMSNorm, SwiGLU, GQA, RoPE, no biases), optionally with
    QKV biases (Qwen2.5) or a mixture of `experts` experts of width `ffn`, top-`topk` (Mixtral)."""

    hidden: int
    ffn: int
    heads: int
    kv_groups: int
    vocab: int = 128256
    qkv_bias: bool = False
    experts: int = 0
    topk: int = 2

    def spec_kwargs(self) -> dict[str, Any]:
        """Arguments of Megatron's layer-spec functions this shape needs."""
        return {"num_experts": self.experts} if self.experts else {}


SHAPES = {
    "llama-3-8b": Shape(4096, 14336, 32, 8),
    "llama-3.3-70b": Shape(8192, 28672, 64, 8),
    "qwen2.5-7b": Shape(3584, 18944, 28, 4, vocab=152064, qkv_bias=True),
    "qwen2.5-32b": Shape(5120, 27648, 40, 8, vocab=152064, qkv_bias=True),
    "qwen2.5-72b": Shape(8192, 29568, 64, 8, vocab=152064, qkv_bias=True),
    "mixtral-8x7b": Shape(4096, 14336, 32, 8, vocab=32000, experts=8, topk=2),
    "tiny": Shape(64, 160, 4, 2, vocab=256),
    # tiny with 16 heads and 8 query groups (GQA): heads and groups divide TP 2, 4 and 8
    "tiny-tp8": Shape(128, 320, 16, 8, vocab=256),
}


# How MoE shapes dispatch tokens (both woven by TokenWeave; megatron_tokenweave/moe.py):
#   allgather  Megatron's all-gather dispatcher, dropless (reads token counts on the host: eager)
#   padded     Megatron's all-to-all dispatcher in drop-and-pad mode with capacity factor
#              experts / top-k: every expert takes every token (no drops, the same outputs),
#              fixed shapes, no host sync: CUDA-graph capturable, at experts / top-k x the FLOPs
MOE_DISPATCH = ("allgather", "padded")


def moe_config(shape: Shape, dispatch: str = "allgather") -> dict[str, Any]:
    """TransformerConfig fields of `shape`'s experts with the `dispatch` of MOE_DISPATCH."""
    if dispatch not in MOE_DISPATCH:
        raise ValueError(f"MoE dispatch must be one of {MOE_DISPATCH}, got {dispatch!r}")
    fields: dict[str, Any] = dict(num_moe_experts=shape.experts, moe_router_topk=shape.topk,
                                  moe_ffn_hidden_size=shape.ffn)
    if dispatch == "allgather":
        return {**fields, "moe_token_dispatcher_type": "allgather"}
    return {**fields, "moe_token_dispatcher_type": "alltoall",
            "moe_expert_capacity_factor": shape.experts / shape.topk,
            "moe_pad_expert_input_to_capacity": True}


def llama_config(
    shape: Shape, num_layers: int, tp: int, moe_dispatch: str = "allgather", **overrides: Any
) -> TransformerConfig:
    """A TransformerConfig for `shape` at tensor-parallel size `tp` (MoE shapes: experts
    dispatched by `moe_dispatch`, one of MOE_DISPATCH)."""
    kwargs: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_groups,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    if shape.qkv_bias:
        kwargs["add_qkv_bias"] = True
    if shape.experts:
        kwargs.update(moe_config(shape, moe_dispatch))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


# TE's attention-backend switches, which Megatron's GPTModel sets process-wide from its config
# (language_module._set_attention_backend) and asserts unchanged at the next build.
TE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN",
                    "NVTE_FLASH_ATTN_V2", "NVTE_FLASH_ATTN_V3", "NVTE_FLASH_ATTN_V4")


def clear_attention_backend_env() -> None:
    """Forget the attention backend of the models built so far in this process, so a model of
    another `attention_backend` / `flash_attention_version` can be built (tests and benchmarks
    that build both; models built earlier then run with the new model's TE switches)."""
    for name in TE_ATTENTION_ENV:
        os.environ.pop(name, None)


def build_gpt(
    config: TransformerConfig, spec: ModuleSpec, vocab: int, max_seq: int, tied: bool = False,
    **kwargs: Any,
) -> GPTModel:
    """A GPTModel with RoPE (embeddings tied to the output layer when `tied`), in eval mode
    (kwargs: pre_process/post_process, ... as GPTModel takes them)."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=max_seq,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
        **kwargs,
    )
    return model.eval()


def pattern_layers(pattern: str) -> int:
    """The layers of a hybrid pattern (`*-|*-` has 4): the config's num_layers."""
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern

    main = parse_hybrid_pattern(pattern).main_pattern or ""
    return sum(symbol in Symbols.VALID_LAYERS for symbol in main)


def build_hybrid(config: TransformerConfig, spec: ModuleSpec, vocab: int, max_seq: int,
                 pattern: str, tied: bool = False, **kwargs: Any) -> HybridModel:
    """A HybridModel of `pattern` with RoPE, in eval mode (kwargs: pre_process/post_process,
    pg_collection, ... as HybridModel takes them)."""
    model = HybridModel(
        config=config,
        hybrid_stack_spec=spec,
        vocab_size=vocab,
        max_sequence_length=max_seq,
        hybrid_layer_pattern=pattern,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
        **kwargs,
    )
    return model.eval()


def stock_hybrid_stack_spec(use_te: bool) -> ModuleSpec:
    """Megatron's hybrid stack spec (TE), or where TE does not import its local-module form
    (megatron_tokenweave.hybrid.local_hybrid_stack_spec)."""
    if use_te:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

        return hybrid_stack_spec
    from megatron_tokenweave.hybrid import local_hybrid_stack_spec

    return local_hybrid_stack_spec()


def stock_layer_spec(shape: Shape, use_te: bool) -> ModuleSpec:
    """Megatron's own GPT layer spec for `shape`: the TE spec, or the local spec with RMSNorm."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    extra = shape.spec_kwargs()
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(**extra)
    return get_gpt_layer_local_spec(normalization="RMSNorm", **extra)


def stock_and_tokenweave(
    shape: Shape,
    num_layers: int,
    tp: int,
    tokenweave_config: Any = None,
    use_te: bool | None = None,
    max_seq: int = 4096,
    **config_overrides: Any,
) -> tuple[GPTModel, GPTModel]:
    """(stock, tokenweave) GPTModels of `shape` with the same (random) weights: Megatron's TE
    layer spec and the TokenWeave TE flavour when `use_te` (default: when TE imports), else the
    local ones. On a GPU both are bf16 CUDA models; on a CPU-only machine fp32 CPU models."""
    from megatron_tokenweave.cpu_compat import cpu_device_scope
    from megatron_tokenweave.spec import get_gpt_layer_tokenweave_spec, te_available

    gpu = torch.cuda.is_available()
    use_te = te_available() if use_te is None else use_te
    if gpu:
        config_overrides = dict(bf16=True, params_dtype=torch.bfloat16, **config_overrides)
    stock_spec = stock_layer_spec(shape, use_te)
    tw_spec = get_gpt_layer_tokenweave_spec(use_te, tokenweave_config, **shape.spec_kwargs())
    with cpu_device_scope():
        config = llama_config(shape, num_layers, tp, **config_overrides)
        stock = build_gpt(config, stock_spec, shape.vocab, max_seq)
        woven = build_gpt(config, tw_spec, shape.vocab, max_seq)
    if gpu:
        stock, woven = stock.cuda(), woven.cuda()
    woven.load_state_dict(stock.state_dict(), strict=True)
    return stock, woven

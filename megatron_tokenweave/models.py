"""Llama-shaped GPT models with random weights, for tests, examples and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
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
    "qwen2.5-72b": Shape(8192, 29568, 64, 8, vocab=152064, qkv_bias=True),
    "mixtral-8x7b": Shape(4096, 14336, 32, 8, vocab=32000, experts=8, topk=2),
    "tiny": Shape(64, 160, 4, 2, vocab=256),
}


def llama_config(shape: Shape, num_layers: int, tp: int, **overrides: Any) -> TransformerConfig:
    """A TransformerConfig for `shape` at tensor-parallel size `tp`."""
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
        kwargs.update(
            num_moe_experts=shape.experts,
            moe_router_topk=shape.topk,
            moe_ffn_hidden_size=shape.ffn,
            moe_token_dispatcher_type="allgather",  # the dispatcher TokenWeave weaves
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(
    config: TransformerConfig, spec: ModuleSpec, vocab: int, max_seq: int, tied: bool = False
) -> GPTModel:
    """A GPTModel with RoPE (embeddings tied to the output layer when `tied`), in eval mode."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=max_seq,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
    )
    return model.eval()

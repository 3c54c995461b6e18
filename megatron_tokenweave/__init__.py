"""megatron-tokenweave: TokenWeave compute-communication overlap for Megatron-Core TP inference."""

from megatron_tokenweave.config import TokenWeaveConfig

__version__ = "0.1.0"
__all__ = ["TokenWeaveConfig", "get_gpt_layer_tokenweave_spec", "get_hybrid_stack_tokenweave_spec",
           "TokenWeaveTransformerLayer"]


def __getattr__(name: str):
    # Lazy: importing the spec imports megatron.core, which the kernel-only paths do not need.
    if name == "get_gpt_layer_tokenweave_spec":
        from megatron_tokenweave.spec import get_gpt_layer_tokenweave_spec

        return get_gpt_layer_tokenweave_spec
    if name == "get_hybrid_stack_tokenweave_spec":
        from megatron_tokenweave.hybrid import get_hybrid_stack_tokenweave_spec

        return get_hybrid_stack_tokenweave_spec
    if name == "TokenWeaveTransformerLayer":
        from megatron_tokenweave.layer import TokenWeaveTransformerLayer

        return TokenWeaveTransformerLayer
    if name in ("tokenweave_spec", "tokenweave_local_spec", "tokenweave_te_spec",
                "tokenweave_hybrid_stack_spec", "tokenweave_hybrid_local_stack_spec",
                "tokenweave_hybrid_te_stack_spec"):
        from megatron_tokenweave import spec

        return getattr(spec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The stock model without its tensor-parallel communication: the ceiling every overlap is
measured against ("the same model with communication removed"). Timing only: the outputs are
wrong (each rank keeps its own partial sums). MoE layers keep their token dispatcher's own TP
all-gather / reduce-scatter (they change tensor shapes: made no-ops, the layer would break), so
for MoE shapes this is a ceiling of the attention's communication only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def no_tp_comm() -> Iterator[None]:
    """Inside: Megatron's and TE's tensor-parallel all-reduces / reduce-scatters of the stock
    spec (row-parallel linears, the vocab-parallel embedding) return their input unreduced."""
    from megatron.core.tensor_parallel import layers

    names = (
        "reduce_from_tensor_model_parallel_region",
        "reduce_scatter_to_sequence_parallel_region",
    )
    saved = {name: getattr(layers, name) for name in names}
    for name in names:
        setattr(layers, name, lambda x, *a, **k: x)
    patched = []
    try:
        import transformer_engine.pytorch.module.linear as te_linear

        saved_te = te_linear.allreduce
        te_linear.allreduce = lambda x, *a, **k: (x, None)
        patched.append((te_linear, "allreduce", saved_te))
    except (ImportError, AttributeError):
        pass
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(layers, name, fn)
        for module, name, fn in patched:
            setattr(module, name, fn)

"""bench/split_cost.py times the GEMMs of one rank's shard of a layer: its shapes must be those
of the linears Megatron builds at that tensor-parallel size (2 gloo ranks, tiny shape)."""

from __future__ import annotations

from _dist import build_model, run_ranks

from megatron_tokenweave.models import SHAPES


def _worker(rank: int, world: int) -> dict:
    from _dist import setup_tp

    setup_tp(world)
    layer = build_model("stock", SHAPES["tiny"], 1, world).decoder.layers[0]
    linears = {"qkv": layer.self_attention.linear_qkv, "proj": layer.self_attention.linear_proj,
               "fc1": layer.mlp.linear_fc1, "fc2": layer.mlp.linear_fc2}
    # Megatron stores [out, in].
    return {name: tuple(reversed(lin.weight.shape)) for name, lin in linears.items()}


def test_split_cost_measures_the_shards_megatron_builds():
    from megatron_tokenweave.bench.split_cost import layer_gemms

    for shards in run_ranks(_worker):
        assert shards == layer_gemms(SHAPES["tiny"], 2)

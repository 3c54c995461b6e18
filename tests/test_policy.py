"""The split policy: tuning tables are matched by key and applied by token count."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.policy import Plan, SplitPolicy, TableKey, load_table

KEY = TableKey("NVIDIA H200", 2, 8192, "bfloat16")
ENTRIES = [
    {"min_tokens": 0, "split": False, "comm_ctas_alone": 64},
    {"min_tokens": 2048, "split": True, "comm_ctas_attn": 8, "comm_ctas_mlp": 32},
]


def _write(tmp_path, key=KEY, entries=ENTRIES, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"gpu": key.gpu, "tp": key.tp, "hidden": key.hidden,
                                "dtype": key.dtype, "entries": entries}))
    return str(path)


def test_config_fields_without_table():
    cfg = TokenWeaveConfig(split_threshold=1000, comm_ctas_attn=4, tuning_table="none")
    policy = SplitPolicy(cfg, KEY)
    assert policy.plan(999) == Plan(False, 4, cfg.comm_ctas_mlp, cfg.comm_ctas_alone)
    assert policy.plan(1000).split is True


def test_table_entries_apply_by_token_count(tmp_path):
    cfg = TokenWeaveConfig(split_threshold=0, tuning_table=_write(tmp_path))
    policy = SplitPolicy(cfg, KEY)
    small, large = policy.plan(2047), policy.plan(4096)
    assert (small.split, small.comm_ctas_alone) == (False, 64)
    assert (large.split, large.comm_ctas_attn, large.comm_ctas_mlp) == (True, 8, 32)
    assert large.comm_ctas_alone == cfg.comm_ctas_alone  # not in the entry: the config's


def test_auto_ignores_tables_of_other_keys(tmp_path, monkeypatch):
    import megatron_tokenweave.policy as policy_mod

    other = TableKey("NVIDIA A100", 2, 8192, "bfloat16")
    monkeypatch.setattr(policy_mod, "SHIPPED_TABLES", tmp_path)
    monkeypatch.setattr(policy_mod, "CACHE_DIR", tmp_path / "cache")
    _write(tmp_path, key=other)
    cfg = TokenWeaveConfig(split_threshold=5, tuning_table="auto")
    assert SplitPolicy(cfg, KEY).entries == []
    assert SplitPolicy(cfg, other).plan(10).comm_ctas_alone == 64


def test_explicit_table_without_matching_key_raises(tmp_path):
    cfg = TokenWeaveConfig(tuning_table=_write(tmp_path, key=TableKey("x", 4, 1, "float16")))
    with pytest.raises(ValueError, match="has no table"):
        SplitPolicy(cfg, KEY)


def test_malformed_table_raises(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"gpu": "g", "tp": 2, "hidden": 8, "dtype": "bfloat16",
                                "entries": [{"min_tokens": 0, "ctas": 3}]}))
    with pytest.raises(ValueError, match="unknown fields"):
        load_table(path)
    path.write_text(json.dumps({"gpu": "g"}))
    with pytest.raises(ValueError, match="not a TokenWeave tuning table"):
        load_table(path)


def test_table_key_of_cpu():
    key = TableKey.of(torch.device("cpu"), 2, 64, torch.float32)
    assert key == TableKey("cpu", 2, 64, "float32")


def _layer_follows_table(rank: int, world: int, table: str) -> list[tuple[int, int]]:
    from _dist import build_model, forward, record_fused_calls, setup_tp

    from megatron_tokenweave.models import SHAPES

    setup_tp(world)
    cfg = TokenWeaveConfig(split_threshold=0, split_align=1, tuning_table=table)
    model = build_model("tokenweave", SHAPES["tiny"], 2, world, cfg)
    counts = []
    for seq in (32, 128):
        tokens = torch.randint(0, SHAPES["tiny"].vocab, (1, seq))
        with record_fused_calls() as calls:
            forward(model, tokens)
        counts.append((seq, len(calls)))
    return counts


def test_layer_plans_from_the_table(tmp_path):
    """A table for this machine (cpu, TP=2, hidden 64, fp32) overrides split_threshold=0: below
    64 tokens one fused op per row-parallel linear, from 64 on two (one per half)."""
    from _dist import run_ranks

    key = TableKey("cpu", 2, 64, "float32")
    table = _write(tmp_path, key=key, entries=[{"min_tokens": 0, "split": False},
                                               {"min_tokens": 64, "split": True}])
    for counts in run_ranks(_layer_follows_table, table):
        assert counts == [(32, 2 * 2), (128, 2 * 2 * 2)]

"""What the user sets wins over the tuning tables; the tables fill only what was left unset.

Checked on the shipped H200 table for hidden 8192, replicated, CUDA graphs (Llama-70B at TP=2),
whose entries start at 0 tokens: no split up to 512 tokens, the copy-engine split from 1K on.
"""

from __future__ import annotations

import pytest

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.policy import SHIPPED_TABLES, SplitPolicy, TableKey, get_policy

KEY = TableKey("NVIDIA H200", 2, 8192, "bfloat16", False, moe=False, cuda_graphs=True)
SIZES = (256, 512, 1024, 2048, 4096, 8192)


@pytest.fixture(autouse=True)
def shipped_tables_only(tmp_path, monkeypatch):
    """"auto" reads the shipped tables only, not this machine's tuning cache."""
    import megatron_tokenweave.policy as policy_mod

    monkeypatch.setattr(policy_mod, "CACHE_DIR", tmp_path / "cache")
    get_policy.cache_clear()  # no policy read with another cache directory


def _plans(cfg: TokenWeaveConfig) -> dict:
    policy = SplitPolicy(cfg, KEY)
    assert policy.entries, f"no shipped table for {KEY} in {SHIPPED_TABLES}"
    return {tokens: policy.plan(tokens) for tokens in SIZES}


def test_readme_example_splits_from_its_threshold():
    """README: `get_gpt_layer_tokenweave_spec(tokenweave_config=TokenWeaveConfig(
    split_threshold=1024))`; the layer reads the config through `from_env`, as here."""
    from megatron_tokenweave.spec import get_gpt_layer_tokenweave_spec

    spec = get_gpt_layer_tokenweave_spec(
        tokenweave_config=TokenWeaveConfig(split_threshold=1024))
    cfg = TokenWeaveConfig.from_env(spec.params["tokenweave_config"])
    assert cfg.explicit == {"split_threshold"}
    plans = {tokens: get_policy(cfg, KEY).plan(tokens) for tokens in SIZES}
    assert {t: p.split for t, p in plans.items()} == {t: t >= 1024 for t in SIZES}
    table = _plans(TokenWeaveConfig())
    # The fields it left unset come from the table.
    for tokens in SIZES:
        assert plans[tokens].comm == table[tokens].comm
        assert plans[tokens].comm_ctas_alone == table[tokens].comm_ctas_alone
        assert plans[tokens].comm_ctas_attn == table[tokens].comm_ctas_attn
    assert plans[512].comm_ctas_alone == 128 and plans[8192].comm_ctas_attn == 64


def test_explicit_threshold_overrides_the_tables_split():
    """split_threshold=100000 never splits (the table splits from 1K); 0 always does."""
    assert not any(p.split for p in _plans(TokenWeaveConfig(split_threshold=100000)).values())
    assert all(p.split for p in _plans(TokenWeaveConfig(split_threshold=0)).values())


def test_explicit_comm_is_planned_at_every_size():
    plans = _plans(TokenWeaveConfig(comm="collectives"))
    assert {p.comm for p in plans.values()} == {"collectives"}
    assert plans[8192].split and not plans[512].split  # the split still from the table
    assert not SplitPolicy(TokenWeaveConfig(comm="collectives"), KEY).may_use("copy_engine")


def test_explicit_ctas_win_over_the_entries():
    plans = _plans(TokenWeaveConfig(comm_ctas_attn=8, comm_ctas_mlp=24, comm_ctas_alone=32))
    assert {(p.comm_ctas_attn, p.comm_ctas_mlp, p.comm_ctas_alone) for p in plans.values()} == {
        (8, 24, 32)}


def test_unset_config_plans_the_table():
    plans = _plans(TokenWeaveConfig())
    assert [plans[t].split for t in SIZES] == [False, False, True, True, True, True]
    assert plans[512].comm == "fused" and plans[512].comm_ctas_alone == 128
    assert plans[2048].comm == "copy_engine" and plans[2048].comm_ctas_attn == 128
    assert SplitPolicy(TokenWeaveConfig(), KEY).may_use("copy_engine")


def test_environment_variables_are_explicit(monkeypatch):
    """TOKENWEAVE_SPLIT_THRESHOLD=1024 (the default's value) is still the user's choice."""
    monkeypatch.setenv("TOKENWEAVE_SPLIT_THRESHOLD", "100000")
    monkeypatch.setenv("TOKENWEAVE_COMM", "fused")
    cfg = TokenWeaveConfig.from_env(TokenWeaveConfig())
    plans = _plans(cfg)
    assert not any(p.split for p in plans.values())
    assert {p.comm for p in plans.values()} == {"fused"}
    monkeypatch.setenv("TOKENWEAVE_SPLIT_THRESHOLD", "1024")
    plans = _plans(TokenWeaveConfig.from_env(TokenWeaveConfig(split_threshold=100000)))
    assert {t: p.split for t, p in plans.items()} == {t: t >= 1024 for t in SIZES}

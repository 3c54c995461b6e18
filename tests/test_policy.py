"""The split policy: tuning tables are matched by key and applied by token count."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from megatron_tokenweave import log as log_mod
from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.policy import Plan, SplitPolicy, TableKey, gpu_name_key, load_table

KEY = TableKey("NVIDIA H200", 2, 8192, "bfloat16", False)
NEVER_SPLIT = 1 << 40
ENTRIES = [
    {"min_tokens": 0, "split": False, "comm_ctas_alone": 64},
    {"min_tokens": 2048, "split": True, "comm_ctas_attn": 8, "comm_ctas_mlp": 32},
]


def _write(tmp_path, key=KEY, entries=ENTRIES, name="t.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"gpu": key.gpu, "tp": key.tp, "hidden": key.hidden,
                                "dtype": key.dtype, "sequence_parallel": key.sequence_parallel,
                                "entries": entries}))
    return str(path)


def test_config_fields_without_table():
    cfg = TokenWeaveConfig(split_threshold=1000, comm_ctas_attn=4, tuning_table="none")
    policy = SplitPolicy(cfg, KEY)
    assert policy.plan(999) == Plan(False, 4, cfg.comm_ctas_mlp, cfg.comm_ctas_alone)
    assert policy.plan(1000).split is True


def test_table_entries_apply_by_token_count(tmp_path):
    cfg = TokenWeaveConfig(tuning_table=_write(tmp_path))
    policy = SplitPolicy(cfg, KEY)
    small, large = policy.plan(2047), policy.plan(4096)
    assert (small.split, small.comm_ctas_alone) == (False, 64)
    assert (large.split, large.comm_ctas_attn, large.comm_ctas_mlp) == (True, 8, 32)
    assert large.comm_ctas_alone == cfg.comm_ctas_alone  # not in the entry: the config's


def test_auto_ignores_tables_of_other_keys(tmp_path, monkeypatch):
    import megatron_tokenweave.policy as policy_mod

    other = TableKey("NVIDIA A100", 2, 8192, "bfloat16", False)
    monkeypatch.setattr(policy_mod, "SHIPPED_TABLES", tmp_path)
    monkeypatch.setattr(policy_mod, "CACHE_DIR", tmp_path / "cache")
    _write(tmp_path, key=other)
    cfg = TokenWeaveConfig(split_threshold=5, tuning_table="auto")
    assert SplitPolicy(cfg, KEY).entries == []
    assert SplitPolicy(cfg, other).plan(10).comm_ctas_alone == 64


def test_explicit_table_without_matching_key_raises(tmp_path):
    cfg = TokenWeaveConfig(tuning_table=_write(tmp_path, key=TableKey("x", 4, 1, "float16", False)))
    with pytest.raises(ValueError, match="has no table"):
        SplitPolicy(cfg, KEY)


def test_malformed_table_raises(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"gpu": "g", "tp": 2, "hidden": 8, "dtype": "bfloat16",
                                "sequence_parallel": False,
                                "entries": [{"min_tokens": 0, "ctas": 3}]}))
    with pytest.raises(ValueError, match="unknown fields"):
        load_table(path)
    path.write_text(json.dumps({"gpu": "g"}))
    with pytest.raises(ValueError, match="not a TokenWeave tuning table"):
        load_table(path)
    path.write_text('{"gpu": "g", ')
    with pytest.raises(ValueError, match=f"{path}: not a JSON file"):
        load_table(path)


@pytest.fixture
def tables_in(tmp_path, monkeypatch, caplog):
    """tmp_path as the only table directory ("auto" finds no cache), log_once's memory cleared
    and the package's log captured from INFO up."""
    import megatron_tokenweave.policy as policy_mod

    monkeypatch.setattr(policy_mod, "SHIPPED_TABLES", tmp_path)
    monkeypatch.setattr(policy_mod, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(log_mod, "_seen", set())
    caplog.set_level(logging.INFO, logger="megatron_tokenweave")
    return tmp_path


@pytest.mark.parametrize("name, want", [
    ("NVIDIA H200", "h200"),
    ("H200 SXM 141GB", "h200"),
    ("NVIDIA H200 141GB HBM3e", "h200"),
    ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
    ("cpu", "cpu"),
    ("h200-nvl", "h200-nvl"),  # idempotent: a table written with a key reads back the same
])
def test_gpu_name_key(name, want):
    assert gpu_name_key(name) == want
    assert TableKey(name, 2, 8, "bfloat16", False).gpu == want


def test_tables_match_on_the_normalized_gpu_name(tables_in, monkeypatch, caplog):
    """The shipped H200 table ("NVIDIA H200") serves an "H200 SXM 141GB"; an H200 NVL (other
    board: power limit, NVLink bridges) gets the defaults, and the log says which."""
    table = _write(tables_in)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "H200 SXM 141GB")
    key = TableKey.of(torch.device("cuda", 0), 2, 8192, torch.bfloat16, False)
    assert key == KEY and SplitPolicy(TokenWeaveConfig(), key).entries == ENTRIES
    assert f"from {table}" in caplog.text
    nvl = TableKey("NVIDIA H200 NVL", 2, 8192, "bfloat16", False)
    assert SplitPolicy(TokenWeaveConfig(), nvl).entries == []
    assert "no tuning table for h200-nvl" in caplog.text
    assert SplitPolicy(TokenWeaveConfig(), nvl).entries == []
    assert caplog.text.count("no tuning table") == 1  # once per key


def test_auto_skips_a_malformed_table_with_a_warning(tables_in, caplog):
    """One bad cached file must not break every model: "auto" skips it, naming it."""
    bad_json = tables_in / "a_bad.json"
    bad_json.write_text("{not json")
    bad_entry = _write(tables_in, entries=[{"min_tokens": 0, "ctas": 3}], name="b_bad.json")
    _write(tables_in, name="c_good.json")
    policy = SplitPolicy(TokenWeaveConfig(), KEY)
    assert policy.entries == ENTRIES
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(bad_json) in m and "not a JSON file" in m for m in warnings)
    assert any(bad_entry in m and "unknown fields" in m for m in warnings)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not a JSON file"),
    ('{"gpu": "NVIDIA H200"}', "not a TokenWeave tuning table"),
    ('[1, 2]', "not a TokenWeave tuning table"),
])
def test_explicit_malformed_table_raises_naming_the_file(tmp_path, text, message):
    path = tmp_path / "mine.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"{path}: {message}"):
        SplitPolicy(TokenWeaveConfig(tuning_table=str(path)), KEY)


def test_table_key_of_cpu():
    key = TableKey.of(torch.device("cpu"), 2, 64, torch.float32, True)
    assert key == TableKey("cpu", 2, 64, "float32", True)
    assert key.file_name() == "cpu_tp2_h64_float32_sp.json"


def test_layouts_have_their_own_tables(tmp_path, monkeypatch):
    """The replicated and sequence-parallel layouts move different bytes: a table measured for
    one is never applied to the other."""
    import megatron_tokenweave.policy as policy_mod

    monkeypatch.setattr(policy_mod, "SHIPPED_TABLES", tmp_path)
    monkeypatch.setattr(policy_mod, "CACHE_DIR", tmp_path / "cache")
    sp_key = TableKey(KEY.gpu, KEY.tp, KEY.hidden, KEY.dtype, True)
    _write(tmp_path, key=sp_key, entries=[{"min_tokens": 0, "comm_ctas_alone": 7}], name="sp.json")
    _write(tmp_path, entries=[{"min_tokens": 0, "comm_ctas_alone": 9}], name="rep.json")
    cfg = TokenWeaveConfig(tuning_table="auto")
    assert SplitPolicy(cfg, sp_key).plan(100).comm_ctas_alone == 7
    assert SplitPolicy(cfg, KEY).plan(100).comm_ctas_alone == 9


def test_table_entries_choose_the_comm_mechanism(tmp_path):
    entries = [{"min_tokens": 0, "split": False},
               {"min_tokens": 2048, "split": True, "comm": "copy_engine"},
               {"min_tokens": 4096, "split": True, "comm": "collectives"}]
    policy = SplitPolicy(TokenWeaveConfig(tuning_table=_write(tmp_path, entries=entries)), KEY)
    assert policy.plan(2047).comm == "fused"
    assert (policy.plan(2048).split, policy.plan(2048).comm) == (True, "copy_engine")
    assert (policy.plan(4096).split, policy.plan(4096).comm) == (True, "collectives")
    assert SplitPolicy(TokenWeaveConfig(comm="collectives", tuning_table="none"), KEY).plan(
        1).comm == "collectives"


def test_table_with_unknown_comm_raises(tmp_path):
    path = _write(tmp_path, entries=[{"min_tokens": 0, "comm": "nvls"}])
    with pytest.raises(ValueError, match="comm must be one of"):
        load_table(path)


@pytest.mark.parametrize("entry, message", [
    ({"min_tokens": 0, "split": "false"}, "split must be true or false"),
    ({"min_tokens": 0, "split": 1}, "split must be true or false"),
    ({"min_tokens": -1, "split": False}, "min_tokens must be an int >= 0"),
    ({"min_tokens": "0", "split": False}, "min_tokens must be an int >= 0"),
    ({"min_tokens": 0, "comm_ctas_alone": "64"}, "comm_ctas_alone must be an int"),
    ({"min_tokens": 0, "comm_ctas_alone": 500}, r"comm_ctas_alone must be an int in \[1, 128\]"),
    ({"min_tokens": 0, "split": True, "comm_ctas_attn": 0}, "comm_ctas_attn must be an int"),
    ({"min_tokens": 0, "gemm_sm_carveout": 16}, "unknown fields"),  # a removed knob
])
def test_table_entries_with_bad_values_raise(tmp_path, entry, message):
    """A table's values obey the config's checks: a string "false" would split (it is truthy)
    and a CTA count past the kernel's barrier slots would fail mid-forward."""
    with pytest.raises(ValueError, match=message):
        load_table(_write(tmp_path, entries=[entry]))


def _layer_follows_table(rank: int, world: int, table: str) -> list[tuple[int, int]]:
    from _dist import build_model, forward, record_fused_calls, setup_tp

    from megatron_tokenweave.models import SHAPES

    setup_tp(world)
    cfg = TokenWeaveConfig(split_align=1, tuning_table=table)
    model = build_model("tokenweave", SHAPES["tiny"], 2, world, cfg)
    counts = []
    for seq in (32, 128):
        tokens = torch.randint(0, SHAPES["tiny"].vocab, (1, seq))
        with record_fused_calls() as calls:
            forward(model, tokens)
        counts.append((seq, len(calls)))
    return counts


def test_layer_plans_from_the_table(tmp_path):
    """A table for this machine (cpu, TP=2, hidden 64, fp32) decides the split the config left
    unset: below 64 tokens one fused op per row-parallel linear, from 64 on two (one per half)."""
    from _dist import run_ranks

    key = TableKey("cpu", 2, 64, "float32", False)
    table = _write(tmp_path, key=key, entries=[{"min_tokens": 0, "split": False},
                                               {"min_tokens": 64, "split": True}])
    for counts in run_ranks(_layer_follows_table, table):
        assert counts == [(32, 2 * 2), (128, 2 * 2 * 2)]


def test_execution_modes_have_their_own_tables_with_fallback(tmp_path, monkeypatch):
    """Eager forwards pay per launch on the host, graphs do not: each mode reads its own table,
    and a mode without one reads the other mode's before falling back to the config."""
    import megatron_tokenweave.policy as policy_mod

    monkeypatch.setattr(policy_mod, "SHIPPED_TABLES", tmp_path)
    monkeypatch.setattr(policy_mod, "CACHE_DIR", tmp_path / "cache")
    eager = TableKey(KEY.gpu, KEY.tp, KEY.hidden, KEY.dtype, False, cuda_graphs=False)
    assert eager.file_name().endswith("_replicated_eager.json")
    _write(tmp_path, entries=[{"min_tokens": 0, "split": True}], name="graphs.json")
    cfg = TokenWeaveConfig(tuning_table="auto")
    assert SplitPolicy(cfg, eager).plan(100).split is True  # only the graph table exists
    path = tmp_path / "eager.json"
    path.write_text(json.dumps({**json.loads(open(_write(tmp_path, name="e.json")).read()),
                                "cuda_graphs": False,
                                "entries": [{"min_tokens": 0, "split": False}]}))
    (tmp_path / "e.json").unlink()
    assert load_table(path)[0] == eager
    assert SplitPolicy(cfg, eager).plan(100).split is False
    assert SplitPolicy(cfg, KEY).plan(100).split is True


def test_tuner_keeps_the_simple_plan_inside_the_noise():
    from megatron_tokenweave.tune import candidates, pick

    assert {"alone64", "split16/16", "collectives", "collectives_split", "ce_split16",
            "ce_alone128"} <= set(candidates())
    assert candidates()["ce_split128"]["comm"] == "copy_engine"
    assert candidates()["gemm_split16"] == dict(split_threshold=0, comm_ctas_attn=16,
                                                comm_ctas_mlp=16, comm="gemm")
    assert candidates()["gemm_alone"]["comm"] == "gemm"
    times = {"alone64": 100.0, "alone128": 101.0, "split16/16": 99.5, "collectives": 99.8}
    assert pick(times, min_gain=0.01) == "alone64"  # 0.5 % is noise
    times["split16/16"] = 98.0
    assert pick(times, min_gain=0.01) == "split16/16"
    assert pick({"alone32": 5.0, "alone64": 4.0, "collectives": 4.5}, 0.01) == "alone64"


def test_explicit_fields_win_over_the_table_and_unset_ones_take_it(tmp_path):
    """An entry fills what the user left unset (its `comm` unnamed: the fused op it measured);
    a field the user set wins, and an explicit split_threshold decides split-or-not."""
    table = _write(tmp_path)
    plan = SplitPolicy(TokenWeaveConfig(tuning_table=table), KEY).plan(4096)
    assert plan == Plan(True, 8, 32, TokenWeaveConfig().comm_ctas_alone, "fused")
    cfg = TokenWeaveConfig(comm="collectives", comm_ctas_mlp=4, split_threshold=NEVER_SPLIT,
                           tuning_table=table)
    assert SplitPolicy(cfg, KEY).plan(4096) == Plan(False, 8, 4, cfg.comm_ctas_alone,
                                                    "collectives")
    cfg = TokenWeaveConfig(split_threshold=0, comm_ctas_alone=16, tuning_table=table)
    assert SplitPolicy(cfg, KEY).plan(100) == Plan(True, 16, 16, 16, "fused")


def test_tuner_entries_start_unsplit_below_the_smallest_measured_count():
    from megatron_tokenweave.tune import table_entries

    measured = {
        1024: {"alone64": 100.0, "alone128": 99.0, "split16/16": 80.0},
        512: {"alone64": 50.0, "alone128": 52.0, "split16/16": 40.0},
    }
    entries = table_entries(measured, min_gain=0.01)
    assert [e["min_tokens"] for e in entries] == [0, 512, 1024]
    assert entries[0] == {"min_tokens": 0, "split": False, "comm_ctas_alone": 64}
    assert entries[1]["split"] and entries[2]["split"]
    assert table_entries({}, 0.01) == []


def test_policy_says_whether_a_plan_can_take_the_copy_engine_path(tmp_path):
    """The layer allocates the copy-engine mirror at its first eager forward when the CUDA-graph
    policy could pick that path (a capture cannot allocate it): from the config or any entry."""
    assert not SplitPolicy(TokenWeaveConfig(tuning_table="none"), KEY).may_use("copy_engine")
    assert SplitPolicy(TokenWeaveConfig(comm="copy_engine", tuning_table="none"),
                       KEY).may_use("copy_engine")
    fused = _write(tmp_path, name="fused.json")
    assert not SplitPolicy(TokenWeaveConfig(tuning_table=fused), KEY).may_use("copy_engine")
    ce = _write(tmp_path, name="ce.json", entries=[
        {"min_tokens": 0, "split": False},
        {"min_tokens": 4096, "split": False, "comm_ctas_alone": 128, "comm": "copy_engine"}])
    policy = SplitPolicy(TokenWeaveConfig(tuning_table=ce), KEY)
    assert policy.may_use("copy_engine") and policy.plan(100).comm == "fused"
    # An explicit comm wins over every entry: the table's copy_engine can no longer be planned.
    explicit = SplitPolicy(TokenWeaveConfig(comm="fused", tuning_table=ce), KEY)
    assert not explicit.may_use("copy_engine")

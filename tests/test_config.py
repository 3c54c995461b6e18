"""TokenWeaveConfig: validation of every field and TOKENWEAVE_* environment overrides."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_tokenweave.config import ENV_PREFIX, TABLE_FIELDS, TokenWeaveConfig


def test_defaults_are_valid_and_frozen():
    cfg = TokenWeaveConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.split_threshold = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, good, bad",
    [
        ("split_threshold", (0, 1, 1024, 10**9), (-1, -1024)),
        ("split_align", (1, 7, 128, 256), (0, -128)),
        # CTA counts stop at the kernel's 128 barrier slots; types are checked (a tuning
        # table's "64" or true is an error, not a count).
        ("comm_ctas_attn", (1, 2, 32, 128), (0, -1, 129, 1024, "16", 16.0, True)),
        ("comm_ctas_mlp", (1, 16, 128), (0, 129, 4096, None)),
        ("comm_ctas_alone", (1, 64, 128), (0, -2, 129, "64")),
        ("max_tokens", (1, 3, 16384), (0, -5, 2.5)),
        ("split_offset", (-64, 0, 5), ("1", 0.5)),
        ("defer_across_layers", (True, False), (1, "true", None)),
        ("fp8_rows", (True, False), (0, "false", None)),
        ("backend", ("auto", "kernel", "reference"), ("foo", "", "AUTO", "nccl")),
        ("comm", ("fused", "collectives", "copy_engine"),
         ("nccl", "", "Fused", "multimem", "copy-engine")),
    ],
)
def test_field_validation(field, good, bad):
    """Values in range construct; values out of range raise ValueError naming the field."""
    for value in good:
        assert getattr(TokenWeaveConfig(**{field: value}), field) == value
    for value in bad:
        with pytest.raises(ValueError, match=field):
            TokenWeaveConfig(**{field: value})


@pytest.mark.parametrize("offset", (-64, -1, 0, 5, 1000))
def test_split_offset_may_be_negative(offset):
    assert TokenWeaveConfig(split_offset=offset).split_offset == offset


def test_from_env_without_variables_returns_base():
    base = TokenWeaveConfig(split_threshold=5, backend="reference", defer_across_layers=False)
    assert TokenWeaveConfig.from_env(base) == base
    assert TokenWeaveConfig.from_env() == TokenWeaveConfig()


@pytest.mark.parametrize(
    "field, raw, want",
    [
        ("split_threshold", "0", 0),
        ("split_threshold", "4097", 4097),
        ("split_align", "64", 64),
        ("split_offset", "-16", -16),
        ("comm_ctas_attn", "8", 8),
        ("comm_ctas_mlp", "32", 32),
        ("comm_ctas_alone", "48", 48),
        ("tuning_table", "none", "none"),
        ("tuning_table", "/tmp/table.json", "/tmp/table.json"),
        ("max_tokens", "65536", 65536),
        ("backend", "reference", "reference"),
        ("backend", "kernel", "kernel"),
        ("defer_across_layers", "0", False),
        ("defer_across_layers", "false", False),
        ("defer_across_layers", "FALSE", False),
        ("defer_across_layers", "1", True),
        ("defer_across_layers", "True", True),
        ("fp8_rows", "0", False),
    ],
)
def test_from_env_parses_each_type(monkeypatch, field, raw, want):
    """TOKENWEAVE_<FIELD> overrides that field (int, str and bool parsing), nothing else, and
    marks a table field explicit."""
    defer = not want if field == "defer_across_layers" else True
    base = TokenWeaveConfig(defer_across_layers=defer)
    monkeypatch.setenv(ENV_PREFIX + field.upper(), raw)
    cfg = TokenWeaveConfig.from_env(base)
    assert getattr(cfg, field) == want
    assert type(getattr(cfg, field)) is type(want)
    others = {f.name for f in dataclasses.fields(cfg) if f.init} - {field}
    assert {n: getattr(cfg, n) for n in others} == {n: getattr(base, n) for n in others}
    assert cfg.explicit == ({field} if field in TABLE_FIELDS else set())


def test_from_env_overrides_several_fields_over_base(monkeypatch):
    monkeypatch.setenv("TOKENWEAVE_SPLIT_ALIGN", "256")
    monkeypatch.setenv("TOKENWEAVE_BACKEND", "reference")
    base = TokenWeaveConfig(split_threshold=77, split_align=8)
    cfg = TokenWeaveConfig.from_env(base)
    assert cfg == dataclasses.replace(base, split_align=256, backend="reference")


@pytest.mark.parametrize(
    "name, raw",
    [
        ("TOKENWEAVE_SPLIT_ALIGN", "abc"),
        ("TOKENWEAVE_SPLIT_THRESHOLD", "1.5"),
        ("TOKENWEAVE_MAX_TOKENS", ""),
        ("TOKENWEAVE_DEFER_ACROSS_LAYERS", "yes"),
        ("TOKENWEAVE_DEFER_ACROSS_LAYERS", "2"),
    ],
)
def test_from_env_unparsable_value_raises(monkeypatch, name, raw):
    """A value that does not parse as the field's type raises ValueError naming the variable."""
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        TokenWeaveConfig.from_env()


@pytest.mark.parametrize(
    "name, raw, field",
    [
        ("TOKENWEAVE_SPLIT_ALIGN", "0", "split_align"),
        ("TOKENWEAVE_COMM_CTAS_MLP", "0", "comm_ctas_mlp"),
        ("TOKENWEAVE_BACKEND", "foo", "backend"),
        ("TOKENWEAVE_SPLIT_THRESHOLD", "-3", "split_threshold"),
    ],
)
def test_from_env_out_of_range_value_is_validated(monkeypatch, name, raw, field):
    """Parsed but invalid values go through the same validation as the constructor."""
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=field):
        TokenWeaveConfig.from_env()


def test_unrelated_variables_are_ignored(monkeypatch):
    monkeypatch.setenv("TOKENWEAVE_NOT_A_FIELD", "1")
    monkeypatch.setenv("SPLIT_ALIGN", "3")
    assert TokenWeaveConfig.from_env() == TokenWeaveConfig()


def test_explicit_names_the_table_fields_the_user_set():
    """Only a value the caller gives counts, even one equal to the default: the table must not
    override TokenWeaveConfig(split_threshold=1024)."""
    assert TokenWeaveConfig().explicit == frozenset()
    assert TokenWeaveConfig(split_threshold=1024, split_align=64).explicit == {"split_threshold"}
    cfg = TokenWeaveConfig(comm="fused", comm_ctas_alone=64)
    assert cfg.explicit == {"comm", "comm_ctas_alone"}
    assert type(TokenWeaveConfig().split_threshold) is not int  # the unset marker ...
    assert TokenWeaveConfig().split_threshold == 1024  # ... reads as the default


def test_explicit_is_part_of_equality_and_hash():
    """The config keys the policy cache: a default and an explicit 1024 plan differently."""
    assert TokenWeaveConfig() != TokenWeaveConfig(split_threshold=1024)
    assert len({TokenWeaveConfig(), TokenWeaveConfig(split_threshold=1024),
                TokenWeaveConfig(split_threshold=1024)}) == 2


def test_replace_keeps_unset_fields_unset():
    base = TokenWeaveConfig(comm_ctas_attn=8)
    cfg = dataclasses.replace(base, split_threshold=1024, max_tokens=64)
    assert cfg.explicit == {"comm_ctas_attn", "split_threshold"}
    assert dataclasses.replace(cfg).explicit == cfg.explicit
    assert dataclasses.replace(TokenWeaveConfig(), backend="reference").explicit == frozenset()
    with pytest.raises(ValueError, match="explicit"):
        dataclasses.replace(cfg, explicit=frozenset())


def test_from_env_marks_variables_explicit_and_keeps_the_base(monkeypatch):
    monkeypatch.setenv("TOKENWEAVE_COMM", "collectives")
    monkeypatch.setenv("TOKENWEAVE_SPLIT_THRESHOLD", "1024")  # the default's value, still set
    cfg = TokenWeaveConfig.from_env(TokenWeaveConfig(comm_ctas_mlp=32))
    assert cfg.explicit == {"comm", "split_threshold", "comm_ctas_mlp"}
    monkeypatch.delenv("TOKENWEAVE_COMM")
    monkeypatch.delenv("TOKENWEAVE_SPLIT_THRESHOLD")
    assert TokenWeaveConfig.from_env().explicit == frozenset()

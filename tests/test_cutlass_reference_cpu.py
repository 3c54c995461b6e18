"""The CUTLASS benchmark reference's plumbing without a GPU (bench/cutlass_gemm.py): one
translation unit per configuration plus the binding, rewritten only when their text changes;
an unknown configuration, a machine without an sm_90 GPU and an installation without the
header are clear errors."""

from __future__ import annotations

import pytest

from megatron_tokenweave.bench import cutlass_gemm


def test_one_translation_unit_per_configuration_rewritten_only_when_changed(tmp_path):
    paths = cutlass_gemm._sources(tmp_path)
    names = {p.rsplit("/", 1)[1] for p in paths}
    assert names == {f"{n}.cu" for n in cutlass_gemm.CONFIGS} | {"bind.cpp"}
    binding = (tmp_path / "bind.cpp").read_text()
    for name, (schedule, (m, n), (cm, cn)) in cutlass_gemm.CONFIGS.items():
        unit = (tmp_path / f"{name}.cu").read_text()
        assert f"TOKENWEAVE_CUTLASS_GEMM({name}," in unit
        assert f"cute::Int<{m}>, cute::Int<{n}>" in unit
        assert f"cute::Int<{cm}>, cute::Int<{cn}>" in unit
        assert ("Pingpong" if schedule == "pingpong" else "Cooperative") in unit
        assert f'm.def("{name}", &{name});' in binding
    stamps = {p: (tmp_path / p).stat().st_mtime_ns for p in names}
    cutlass_gemm._sources(tmp_path)
    assert stamps == {p: (tmp_path / p).stat().st_mtime_ns for p in names}
    changed = next(iter(cutlass_gemm.CONFIGS)) + ".cu"
    (tmp_path / changed).write_text("// an older version\n")
    stamps[changed] = (tmp_path / changed).stat().st_mtime_ns
    cutlass_gemm._sources(tmp_path)
    assert "TOKENWEAVE_CUTLASS_GEMM" in (tmp_path / changed).read_text()
    assert {p for p in names if (tmp_path / p).stat().st_mtime_ns != stamps[p]} == {changed}


def test_cluster_shapes_cover_one_cta_and_pairs_along_each_dimension():
    clusters = {c for _, _, c in cutlass_gemm.CONFIGS.values()}
    assert clusters == {(1, 1), (2, 1), (1, 2)}


def test_unknown_configuration_is_a_value_error():
    with pytest.raises(ValueError, match="unknown CUTLASS configuration"):
        cutlass_gemm.gemm("coop_64x64_c4x4")


def test_without_a_gpu_loading_says_why(monkeypatch):
    monkeypatch.setattr(cutlass_gemm.torch.cuda, "is_available", lambda: False)
    with pytest.raises(cutlass_gemm.CutlassUnavailableError, match="sm_90"):
        cutlass_gemm.load()


def test_without_the_header_loading_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(cutlass_gemm.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cutlass_gemm.torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(cutlass_gemm, "HEADER", tmp_path / "missing.cuh")
    with pytest.raises(cutlass_gemm.CutlassUnavailableError, match="source checkout"):
        cutlass_gemm.load()

"""The CUDA extension's build flags come from one place (megatron_tokenweave/build_flags.py) for
its three users: setup.py, the JIT build (kernels._ext) and .ci/compile_csrc.sh; and the arch list
(TOKENWEAVE_CUDA_ARCHS) is validated with clear errors. CPU only: nothing is compiled."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tokenweave import build_flags
from megatron_tokenweave.build_flags import ArchListError, parse_archs

ROOT = Path(__file__).resolve().parents[1]
USERS = ["setup.py", "megatron_tokenweave/kernels/_ext.py", ".ci/compile_csrc.sh"]


def _load_setup_py():
    spec = importlib.util.spec_from_file_location("_tokenweave_setup_py", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() itself runs only as __main__
    return module


# --- the arch list ---------------------------------------------------------------------------


def test_default_is_hopper():
    assert parse_archs() == [90]
    assert build_flags.nvcc_flags() == [*build_flags.NVCC_BASE_FLAGS,
                                         "-gencode=arch=compute_90a,code=sm_90a"]


@pytest.mark.parametrize("value, archs", [
    ("90", [90]), ("80;90", [80, 90]), ("90,80", [80, 90]), (" 80 ; 90 ;", [80, 90]),
    ("90;90", [90]), ("100", [100]), ("", [90]), ("  ", [90]),
])
def test_env_arch_list(monkeypatch, value, archs):
    monkeypatch.setenv("TOKENWEAVE_CUDA_ARCHS", value)
    assert parse_archs() == archs
    target = {90: "90a"}  # Hopper builds its architecture-specific target (wgmma)
    assert build_flags.nvcc_flags()[-len(archs):] == [
        f"-gencode=arch=compute_{target.get(a, a)},code=sm_{target.get(a, a)}" for a in archs]
    assert ("--threads=0" in build_flags.nvcc_flags()) == (len(archs) > 1)


@pytest.mark.parametrize("value, words", [
    ("abc", ["TOKENWEAVE_CUDA_ARCHS='abc'", "'abc' is not a compute capability", '"80;90"']),
    ("80;nine", ["'nine' is not a compute capability"]),
    ("9.0", ["'9.0' is not a compute capability", 'write "90"']),
    ("8.0;9.0", ["'8.0'", 'write "80"']),
    ("sm_90", ['write "90"']),
    ("90a", ["'90a' is not a compute capability"]),
    ("70;90", ["sm_70 is not supported", "sm_80", "sm_90 (Hopper)"]),
    (";", ["no archs given"]),
])
def test_bad_arch_lists_say_why(monkeypatch, value, words):
    monkeypatch.setenv("TOKENWEAVE_CUDA_ARCHS", value)
    for call in (parse_archs, build_flags.nvcc_flags):
        with pytest.raises(ArchListError) as info:
            call()
        for w in words:
            assert w in str(info.value)
    assert isinstance(info.value, ValueError)


def test_explicit_list_ignores_env(monkeypatch):
    monkeypatch.setenv("TOKENWEAVE_CUDA_ARCHS", "bad")
    assert parse_archs("80;90") == [80, 90]
    assert build_flags.nvcc_flags([90]) == build_flags.nvcc_flags("90")
    with pytest.raises(ArchListError, match="arch list '8x'"):
        parse_archs("8x")


def test_check_archs_cover_a100_and_hopper():
    assert parse_archs(build_flags.CHECK_ARCHS) == [80, 90]


def test_cli(capsys, monkeypatch):
    assert build_flags.main(["nvcc", "--archs", "80;90"]) == 0
    assert capsys.readouterr().out.split() == build_flags.nvcc_flags("80;90")
    assert build_flags.main(["nvcc", "--archs", "check"]) == 0
    assert capsys.readouterr().out.split() == build_flags.nvcc_flags(build_flags.CHECK_ARCHS)
    assert build_flags.main(["cxx"]) == 0
    assert capsys.readouterr().out.split() == build_flags.cxx_flags()
    monkeypatch.setenv("TOKENWEAVE_CUDA_ARCHS", "80,90")
    assert build_flags.main(["archs"]) == 0
    assert capsys.readouterr().out.split() == ["80", "90"]
    monkeypatch.setenv("TOKENWEAVE_CUDA_ARCHS", "9.0")
    assert build_flags.main(["nvcc"]) == 2
    err = capsys.readouterr().err
    assert "TOKENWEAVE_CUDA_ARCHS='9.0'" in err and 'write "90"' in err


# --- one place: the three users --------------------------------------------------------------


@pytest.mark.parametrize("user", USERS)
def test_no_user_spells_the_flags_itself(user):
    text = (ROOT / user).read_text()
    for flag in [*build_flags.NVCC_BASE_FLAGS, "code=sm_", "NVCC_FLAGS ="]:
        assert flag not in text, f"{user} has its own {flag!r}: use megatron_tokenweave/build_flags"
    assert "build_flags" in text


@pytest.mark.parametrize("archs", [None, "80;90"])
def test_setup_py_uses_the_module(monkeypatch, archs):
    if archs is not None:
        monkeypatch.setenv("TOKENWEAVE_CUDA_ARCHS", archs)
    args = _load_setup_py().extra_compile_args()
    assert args == {"nvcc": build_flags.nvcc_flags(), "cxx": build_flags.cxx_flags()}


def test_setup_py_exits_with_the_reason(monkeypatch):
    monkeypatch.setenv("TOKENWEAVE_CUDA_ARCHS", "9.0")
    with pytest.raises(SystemExit) as info:
        _load_setup_py().extra_compile_args()
    assert "megatron-tokenweave: TOKENWEAVE_CUDA_ARCHS='9.0'" in str(info.value.code)


def test_setup_py_flags_need_neither_torch_nor_the_package():
    """setup.py runs before torch or megatron_tokenweave may be importable: both blocked here."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['megatron_tokenweave'] = None\n"
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('s', {str(ROOT / 'setup.py')!r})\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "print(' '.join(m.extra_compile_args()['nvcc']))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWEAVE_")}
    env["TOKENWEAVE_CUDA_ARCHS"] = "80;90"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == build_flags.nvcc_flags("80;90")


@pytest.mark.parametrize("archs", [None, "80;90"])
def test_jit_build_uses_the_module(monkeypatch, tmp_path, archs):
    import torch.utils.cpp_extension as cpp_extension

    from megatron_tokenweave.kernels import _ext

    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    monkeypatch.setenv("TOKENWEAVE_BUILD_DIR", str(tmp_path))
    if archs is not None:
        monkeypatch.setenv("TOKENWEAVE_CUDA_ARCHS", archs)
    _ext._jit_build(False)
    (kw,) = calls
    assert kw["extra_cuda_cflags"] == build_flags.nvcc_flags()
    assert kw["extra_cflags"] == build_flags.cxx_flags()


def _compile_script(tmp_path, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWEAVE_")}
    env.update(PYTHON=sys.executable, **env_extra)
    return subprocess.run(["bash", ".ci/compile_csrc.sh", "--print-flags", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("archs", [None, "90"])
def test_compile_script_uses_the_module(tmp_path, archs):
    """CI checks CHECK_ARCHS (80 and 90) unless TOKENWEAVE_CUDA_ARCHS says otherwise."""
    out = _compile_script(tmp_path, **({} if archs is None else {"TOKENWEAVE_CUDA_ARCHS": archs}))
    assert out.returncode == 0, out.stdout + out.stderr
    flags = out.stdout.split("\n")
    ours = build_flags.nvcc_flags(build_flags.CHECK_ARCHS if archs is None else archs)
    assert flags[:len(ours)] == ours
    assert not any(f.startswith("-gencode") for f in flags[len(ours):])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_compile_script_refuses_a_bad_arch_list(tmp_path):
    out = _compile_script(tmp_path, TOKENWEAVE_CUDA_ARCHS="9.0")
    assert out.returncode == 2
    assert "TOKENWEAVE_CUDA_ARCHS='9.0'" in out.stderr and 'write "90"' in out.stderr

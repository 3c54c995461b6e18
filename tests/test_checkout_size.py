"""The checkout's tracked files travel to the GPU machine with every device call, whose limit
(64 MiB) must also hold what the call carries, the largest being a 55 MiB part of TE's core
wheel (`../shared/device/stage.sh te`): the tracked files stay under 8.5 MiB."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = int(8.5 * 2**20)


def test_tracked_files_fit_beside_a_wheel_part() -> None:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                                check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / p for p in listed.split("\0") if p]
    total = sum(p.stat().st_size for p in paths if p.is_file())
    assert total <= LIMIT_BYTES, (
        f"tracked files take {total / 2**20:.2f} MiB, over {LIMIT_BYTES / 2**20} MiB: plots "
        "through bench.report.save_plot (256 colours), large result tables trimmed")

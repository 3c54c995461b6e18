"""Shared fixtures of the CPU test suite.

* tests/ is put on sys.path so that spawned ranks can unpickle the module-level worker functions
  of the test modules and of `_dist` (multiprocessing's spawn copies the parent's sys.path).
* TOKENWEAVE_* variables of the caller's environment are removed for every test, so that
  `TokenWeaveConfig.from_env` sees only what a test sets.
* `single_rank_group`: a 1-rank gloo process group plus Megatron's parallel state at TP=1, for the
  in-process tests that need a group (bad input, specs, the TP=1 fallback).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def pytest_collection_modifyitems(config, items):
    """A default per-test timeout where pytest-timeout is installed (it is optional)."""
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(300))


@pytest.fixture(autouse=True)
def _no_tokenweave_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("TOKENWEAVE_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def single_rank_group():
    """The WORLD group of a 1-rank gloo job, with Megatron's parallel state at TP=1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_tokenweave.launch import initialize_model_parallel

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            initialize_model_parallel(1)
            yield dist.group.WORLD
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()

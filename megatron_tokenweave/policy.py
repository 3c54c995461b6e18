"""Split policy: per forward, whether to split the tokens and how many CTAs the kernel gets.

Chosen from a tuning table measured for (GPU, TP size, hidden size, dtype, layout, MoE or dense,
CUDA graphs or eager) by
`python -m megatron_tokenweave.tune`, else from TokenWeaveConfig. Tables are JSON:

    {"gpu": "NVIDIA H200", "tp": 2, "hidden": 8192, "dtype": "bfloat16",
     "sequence_parallel": false, "moe": false, "cuda_graphs": true,
     "entries": [{"min_tokens": 0, "split": false, "comm_ctas_alone": 64},
                 {"min_tokens": 8192, "split": true, "comm": "collectives"}, ...]}

An entry applies from `min_tokens` (tokens of one forward, all shards) up to the next entry.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.log import log_once
from megatron_tokenweave.ops.validate import Comm

SHIPPED_TABLES = Path(__file__).parent / "tables"
CACHE_DIR = Path(os.environ.get("TOKENWEAVE_CACHE", Path.home() / ".cache" / "megatron_tokenweave"))
TUNABLE = ("comm", "comm_ctas_attn", "comm_ctas_mlp", "comm_ctas_alone", "gemm_sm_carveout")


@dataclass(frozen=True)
class Plan:
    """What one forward does: split or not, the communication mechanism, and the kernel's CTAs
    in each phase."""

    split: bool
    comm_ctas_attn: int
    comm_ctas_mlp: int
    comm_ctas_alone: int
    gemm_sm_carveout: int = 0
    comm: Comm = "fused"


@dataclass(frozen=True)
class TableKey:
    gpu: str
    tp: int
    hidden: int
    dtype: str
    sequence_parallel: bool
    moe: bool = False  # MoE layers pay more per split (two dispatches): they get their own table
    # Captured in a CUDA graph or run eagerly: a split doubles the launches, which eager
    # execution pays on the host (measured: the split wins graphed at 4K-8K tokens, loses eager).
    cuda_graphs: bool = True

    @classmethod
    def of(
        cls, device: torch.device, tp: int, hidden: int, dtype: torch.dtype,
        sequence_parallel: bool, moe: bool = False, cuda_graphs: bool = True,
    ) -> TableKey:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        dtype_name = str(dtype).removeprefix("torch.")
        return cls(gpu, tp, hidden, dtype_name, bool(sequence_parallel), bool(moe),
                   bool(cuda_graphs))

    def file_name(self) -> str:
        layout = "sp" if self.sequence_parallel else "replicated"
        kind = "_moe" if self.moe else ""
        mode = "" if self.cuda_graphs else "_eager"
        gpu = self.gpu.replace(" ", "_")
        return f"{gpu}_tp{self.tp}_h{self.hidden}_{self.dtype}_{layout}{kind}{mode}.json"


def load_table(path: str | Path) -> tuple[TableKey, list[dict]]:
    """Read and validate one table file."""
    with open(path) as f:
        data = json.load(f)
    try:
        key = TableKey(
            str(data["gpu"]), int(data["tp"]), int(data["hidden"]), str(data["dtype"]),
            bool(data["sequence_parallel"]), bool(data.get("moe", False)),
            bool(data.get("cuda_graphs", True)),
        )
        entries = sorted(data["entries"], key=lambda e: int(e["min_tokens"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a TokenWeave tuning table ({exc})") from None
    for entry in entries:
        unknown = set(entry) - {"min_tokens", "split", *TUNABLE}
        if unknown:
            raise ValueError(f"{path}: unknown fields {sorted(unknown)} in {entry}")
        if not isinstance(entry.get("split", False), bool):
            raise ValueError(f"{path}: split must be true or false in {entry}")
        if isinstance(entry["min_tokens"], bool) or not isinstance(entry["min_tokens"], int) \
                or entry["min_tokens"] < 0:
            raise ValueError(f"{path}: min_tokens must be an int >= 0 in {entry}")
        try:  # the tunable fields obey the config's own checks (types, CTA limits, comm)
            TokenWeaveConfig(**{k: v for k, v in entry.items() if k in TUNABLE})
        except ValueError as exc:
            raise ValueError(f"{path}: {exc} in {entry}") from None
    return key, entries


class SplitPolicy:
    """Plans for one (device, TP size, hidden, dtype): the matching table, else the config."""

    def __init__(self, cfg: TokenWeaveConfig, key: TableKey) -> None:
        self.cfg = cfg
        self.key = key
        self.entries = self._find_entries()

    def _candidates(self) -> list[str]:
        if self.cfg.tuning_table in ("", "none"):
            return []
        if self.cfg.tuning_table != "auto":
            return [self.cfg.tuning_table]
        return sorted(glob.glob(str(CACHE_DIR / "tuning" / "*.json"))) + sorted(
            glob.glob(str(SHIPPED_TABLES / "*.json"))
        )

    def _find_entries(self) -> list[dict]:
        """The table of this key; else the one measured in the other execution mode (closer to
        this machine than the config's defaults)."""
        other_mode = dataclasses.replace(self.key, cuda_graphs=not self.key.cuda_graphs)
        tables = [(path, *load_table(path)) for path in self._candidates()]
        for want in (self.key, other_mode):
            for path, key, entries in tables:
                if key == want:
                    log_once(f"table:{path}:{self.key}",
                             f"TokenWeave: split policy for {self.key} from {path}")
                    return entries
        if self.cfg.tuning_table not in ("auto", "", "none"):
            raise ValueError(f"{self.cfg.tuning_table} has no table for {self.key}")
        return []

    @property
    def may_copy_engine(self) -> bool:
        """Whether a plan of this policy can run the copy-engine data path (which needs the
        workspace's mirror allocated outside any CUDA-graph capture)."""
        return self.cfg.comm == "copy_engine" or any(
            entry.get("comm") == "copy_engine" for entry in self.entries)

    def plan(self, tokens: int) -> Plan:
        """The plan for a forward of `tokens` tokens (all shards together)."""
        base = Plan(
            split=tokens >= self.cfg.split_threshold,
            comm_ctas_attn=self.cfg.comm_ctas_attn,
            comm_ctas_mlp=self.cfg.comm_ctas_mlp,
            comm_ctas_alone=self.cfg.comm_ctas_alone,
            gemm_sm_carveout=self.cfg.gemm_sm_carveout,
            comm=self.cfg.comm,
        )
        chosen = None
        for entry in self.entries:
            if int(entry["min_tokens"]) <= tokens:
                chosen = entry
        if chosen is None:
            return base
        # A table entry is a measured plan: what it does not name is what the tuner measured
        # (the fused op, no carve-out), never the config's setting.
        overrides = {"comm": "fused", "gemm_sm_carveout": 0}
        overrides.update((k, v) for k, v in chosen.items() if k != "min_tokens")
        return dataclasses.replace(base, **overrides)


@functools.lru_cache(maxsize=64)
def get_policy(cfg: TokenWeaveConfig, key: TableKey) -> SplitPolicy:
    """One policy per (config, table key): tables are read once per process."""
    return SplitPolicy(cfg, key)

"""Split policy: per forward, whether to split the tokens and how many CTAs the kernel gets.

Chosen from TokenWeaveConfig and a tuning table measured for (GPU, TP size, hidden size, dtype,
layout, MoE or dense, CUDA graphs or eager, the GEMMs' precision: "precision" may be left out
of a file for "native", GEMMs in the dtype) by `python -m megatron_tokenweave.tune`. Tables are
JSON:

    {"gpu": "NVIDIA H200", "tp": 2, "hidden": 8192, "dtype": "bfloat16",
     "sequence_parallel": false, "moe": false, "cuda_graphs": true, "precision": "native",
     "entries": [{"min_tokens": 0, "split": false, "comm_ctas_alone": 64},
                 {"min_tokens": 8192, "split": true, "comm": "collectives"}, ...]}

An entry applies from `min_tokens` (tokens of one forward, all shards) up to the next entry. Its
values fill only the config fields the user left unset (TokenWeaveConfig's precedence rule); the
GPU is matched on `gpu_name_key`. With `tuning_table="auto"` a table file that does not read
as a table is skipped with a warning naming it, so one bad cached file breaks no model.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_tokenweave.config import TABLE_FIELDS, TokenWeaveConfig
from megatron_tokenweave.log import log_once
from megatron_tokenweave.ops.validate import Comm
from megatron_tokenweave.precision import NATIVE

SHIPPED_TABLES = Path(__file__).parent / "tables"
CACHE_DIR = Path(os.environ.get("TOKENWEAVE_CACHE", Path.home() / ".cache" / "megatron_tokenweave"))
# The fields an entry may name besides min_tokens and split (which stands for split_threshold).
TUNABLE = tuple(name for name in TABLE_FIELDS if name != "split_threshold")
# Name tokens that say nothing a table measures: the vendor, memory size or type, and the SXM
# socket (the board these chips' tables are measured on).
_NAME_NOISE = re.compile(r"nvidia|\d+gb|hbm\d*e?|sxm\d*")


def gpu_name_key(name: str) -> str:
    """The GPU name tables are matched on: lowercase tokens of the device name, less the vendor,
    memory size/type and SXM tokens, joined by "-". "NVIDIA H200" and "H200 SXM 141GB" -> "h200",
    "NVIDIA A100-SXM4-80GB" -> "a100", "cpu" -> "cpu". Other board names stay part of the key:
    "NVIDIA H200 NVL" -> "h200-nvl", "NVIDIA H100 PCIe" -> "h100-pcie". Those boards carry the
    same chip under a lower power limit (H100 PCIe also with fewer SMs) and link GPUs through
    NVLink bridges or PCIe instead of NVSwitch; a table measures exactly that balance of GEMM
    time against communication, so they do not borrow the SXM board's table (none ships for
    them: the config's defaults apply until one is tuned there)."""
    tokens = re.split(r"[\s_\-/]+", name.strip().lower())
    return "-".join(t for t in tokens if t and not _NAME_NOISE.fullmatch(t))


@dataclass(frozen=True)
class Plan:
    """What one forward does: split or not, the communication mechanism, and the kernel's CTAs
    in each phase."""

    split: bool
    comm_ctas_attn: int
    comm_ctas_mlp: int
    comm_ctas_alone: int
    comm: Comm = "fused"


@dataclass(frozen=True)
class TableKey:
    """What a table was measured for; `gpu` is kept as `gpu_name_key(gpu)`."""

    gpu: str
    tp: int
    hidden: int
    dtype: str
    sequence_parallel: bool
    moe: bool = False  # MoE layers pay more per split (two dispatches): they get their own table
    # Captured in a CUDA graph or run eagerly: a split doubles the launches, which eager
    # execution pays on the host (measured: the split wins graphed at 4K-8K tokens, loses eager).
    cuda_graphs: bool = True
    # The GEMMs' precision (precision.gemm_precision): FP8 GEMMs can take up to about half the
    # time of bf16 ones (not measured here), which moves the split decisions, so an FP8 model
    # never reads a bf16 table.
    precision: str = NATIVE

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu", gpu_name_key(self.gpu))

    @classmethod
    def of(
        cls, device: torch.device, tp: int, hidden: int, dtype: torch.dtype,
        sequence_parallel: bool, moe: bool = False, cuda_graphs: bool = True,
        precision: str = NATIVE,
    ) -> TableKey:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        dtype_name = str(dtype).removeprefix("torch.")
        return cls(gpu, tp, hidden, dtype_name, bool(sequence_parallel), bool(moe),
                   bool(cuda_graphs), precision)

    def file_name(self) -> str:
        layout = "sp" if self.sequence_parallel else "replicated"
        kind = "_moe" if self.moe else ""
        mode = "" if self.cuda_graphs else "_eager"
        gemms = "" if self.precision == NATIVE else f"_{self.precision}"
        return (f"{self.gpu}_tp{self.tp}_h{self.hidden}_{self.dtype}{gemms}_{layout}{kind}{mode}"
                ".json")


def load_table(path: str | Path) -> tuple[TableKey, list[dict]]:
    """Read and validate one table file; ValueError naming the file if it is not a table."""
    with open(path) as f:
        try:
            data = json.load(f)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path}: not a JSON file ({exc})") from None
    try:
        key = TableKey(
            str(data["gpu"]), int(data["tp"]), int(data["hidden"]), str(data["dtype"]),
            bool(data["sequence_parallel"]), bool(data.get("moe", False)),
            bool(data.get("cuda_graphs", True)), str(data.get("precision", NATIVE)),
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
    """Plans for one (device, TP size, hidden, dtype, ...): the config's explicit fields, else
    the matching table's entry, else the config's defaults."""

    def __init__(self, cfg: TokenWeaveConfig, key: TableKey) -> None:
        self.cfg = cfg
        self.key = key
        self.entries = self._find_entries()

    def _explicit_path(self) -> bool:
        return self.cfg.tuning_table not in ("auto", "", "none")

    def _candidates(self) -> list[str]:
        if self.cfg.tuning_table in ("", "none"):
            return []
        if self._explicit_path():
            return [self.cfg.tuning_table]
        return sorted(glob.glob(str(CACHE_DIR / "tuning" / "*.json"))) + sorted(
            glob.glob(str(SHIPPED_TABLES / "*.json"))
        )

    def _find_entries(self) -> list[dict]:
        """The table of this key; else the one measured in the other execution mode (closer to
        this machine than the config's defaults). A table the user named must read; one found
        by "auto" that does not is skipped with a warning."""
        tables = []
        for path in self._candidates():
            try:
                tables.append((path, *load_table(path)))
            except (OSError, ValueError) as exc:
                if self._explicit_path():
                    raise
                log_once(f"bad-table:{path}", f"TokenWeave: skipping tuning table {path}: {exc}")
        other_mode = dataclasses.replace(self.key, cuda_graphs=not self.key.cuda_graphs)
        for want in (self.key, other_mode):
            for path, key, entries in tables:
                if key == want:
                    log_once(f"table:{path}:{self.key}",
                             f"TokenWeave: split policy for {self.key} from {path}", logging.INFO)
                    return entries
        if self._explicit_path():
            raise ValueError(f"{self.cfg.tuning_table} has no table for {self.key}")
        if self.cfg.tuning_table == "auto":
            log_once(f"no-table:{self.key}",
                     f"TokenWeave: no tuning table for {self.key.gpu} ({self.key}), defaults")
        return []

    def may_use(self, comm: str) -> bool:
        """Whether a plan of this policy can pick the mechanism `comm` ("copy_engine" needs the
        communicator's mirror, "gemm" its inbox: both made outside any CUDA-graph capture)."""
        return self.cfg.comm == comm or ("comm" not in self.cfg.explicit and any(
            entry.get("comm") == comm for entry in self.entries))

    def plan(self, tokens: int) -> Plan:
        """The plan for a forward of `tokens` tokens (all shards together): each field from the
        config where the user set it, else from the entry for `tokens` where it names the
        field, else the config's default."""
        entry: dict = {}
        for candidate in self.entries:
            if int(candidate["min_tokens"]) <= tokens:
                entry = candidate
        explicit = self.cfg.explicit

        def value(name: str) -> object:
            if name in entry and name not in explicit:
                return entry[name]
            return getattr(self.cfg, name)

        if "split" in entry and "split_threshold" not in explicit:
            split = entry["split"]
        else:
            split = tokens >= self.cfg.split_threshold
        return Plan(  # plain int / str: the config's unset defaults are int / str subclasses
            split=split,
            comm_ctas_attn=int(value("comm_ctas_attn")),
            comm_ctas_mlp=int(value("comm_ctas_mlp")),
            comm_ctas_alone=int(value("comm_ctas_alone")),
            comm=str(value("comm")),
        )


@functools.lru_cache(maxsize=64)
def get_policy(cfg: TokenWeaveConfig, key: TableKey) -> SplitPolicy:
    """One policy per (config, table key): tables are read once per process."""
    return SplitPolicy(cfg, key)

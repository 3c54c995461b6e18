"""TokenWeaveConfig: the woven schedule's knobs, validated once, overridable by environment."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

from megatron_tokenweave.ops.validate import COMMS, MAX_CTAS, Comm

Backend = Literal["auto", "kernel", "reference", "multimem"]
_BACKENDS = ("auto", "kernel", "reference", "multimem")
ENV_PREFIX = "TOKENWEAVE_"
# The fields a tuning table can fill (split_threshold through an entry's `split`): only where the
# user left them unset.
TABLE_FIELDS = ("split_threshold", "comm", "comm_ctas_attn", "comm_ctas_mlp", "comm_ctas_alone")
# (field, lowest, highest or None): the integer fields and their valid ranges. CTA counts stop
# at the kernel's limit (its signal pad has one barrier slot per CTA index).
_INT_RANGES = (
    ("split_threshold", 0, None),
    ("split_align", 1, None),
    ("split_offset", None, None),
    ("comm_ctas_attn", 1, MAX_CTAS),
    ("comm_ctas_mlp", 1, MAX_CTAS),
    ("comm_ctas_alone", 1, MAX_CTAS),
    ("max_tokens", 1, None),
)


class _DefaultInt(int):
    """The default of a table field: an int that still reads as "not set by the user" after
    `dataclasses.replace` (and so `from_env`) copies it into a new config."""


class _DefaultStr(str):
    """The same for the str field `comm`."""


@dataclass(frozen=True)
class TokenWeaveConfig:
    """How a TokenWeave layer splits tokens and communicates.

    split_threshold: token count (rows of the whole forward, all ranks' shards together) from
        which the tokens are split in two halves; below it one stream runs the fused op alone
        (decode, small prefill). 0 forces the split whenever there are at least two rows a chunk.
    split_align: the first half's rows per chunk are rounded down to a multiple of this
        (GEMM waves).
    split_offset: rows added to the first half after rounding (wave-aware tuning); may be negative.
    comm_ctas_attn / comm_ctas_mlp: CTAs of the fused kernel beside the other half's GEMMs,
        after attention / after the MLP.
    comm_ctas_alone: CTAs of the fused kernel when the tokens are not split (nothing runs beside
        it, so it may take many SMs).
    max_tokens: workspace capacity in rows (tokens of one forward, all shards together).
    backend: "kernel" (CUDA P2P kernel), "reference" (the fp32 torch.distributed definition), or
        "auto" (the kernel where every TP rank is on this node with peer access, TP 2..8 and
        hidden <= 32768; else NCCL collectives in the activations' dtype on GPUs, the reference
        on CPU). Every rank must have the same settings (megatron_tokenweave.communicator).
        "multimem" (opt-in, UNTESTED on this project's machines, which forbid NVLink multicast):
        the kernel over a torch symmetric-memory buffer with a multicast mapping, whose SM path
        runs the multimem (NVLink SHARP) kernel; needs TOKENWEAVE_ALLOW_MULTIMEM=1 too, and no
        multicast kill switch, torch reporting multicast for the GPU, one node, sm_90+; else
        every rank raises naming the failing condition (never a silent fallback).
    comm: how the fused op communicates: "fused" (the backend above: one P2P kernel does the
        all-reduce, residual add and norm) or "collectives" (torch.distributed collectives in the
        activations' dtype, then add and norm: the stock mechanism, which NCCL runs faster than
        the kernel at large token counts on some machines; split or not like the kernel), or
        "copy_engine" (the kernel's copy-engine data path: peers' rows move by cudaMemcpyAsync,
        the SMs only reduce and normalize local rows; split, only the transfer runs beside the
        other half's GEMMs and the reduction waits for the rows' consumer on the main stream;
        the workspace then holds a local mirror of the peers' partial region), or "gemm" (the
        row-parallel GEMM communicates: its epilogue stores each output tile into the inbox of
        the rank that owns those rows and flags it, and the owner's reduction + add + norm
        waits on those flags; the GEMM takes the SMs the other half's op leaves; the
        communicator then holds an inbox of about max_tokens x hidden per rank; on backends
        without the kernels the same data movement runs on collectives).
    defer_across_layers: let half B's post-MLP op overlap the next layer's attention.
    fp8_rows: in FP8 (TE's delayed or blockwise recipe, replicated layout) the fused op writes
        the next linear's input already quantized (ops.fp8_rows), so that linear quantizes
        nothing; off: the op writes bf16 rows and TE's quantizer runs before the GEMM.
    tuning_table: "auto" (a table measured by `python -m megatron_tokenweave.tune` for this GPU,
        TP size, hidden size and dtype, from the cache or the shipped ones, fills the table fields
        per token count), "none" (use the fields above), or a table's path.

    Precedence: a table field (TABLE_FIELDS) the user sets, here or through TOKENWEAVE_<FIELD>,
    wins over the tuning table; the table fills only the ones left unset, and the defaults above
    fill the rest. An explicit split_threshold decides split-or-not at every token count (the
    table's `split` is ignored), so `TokenWeaveConfig(split_threshold=1024)` does what it says.
    `explicit` names the table fields that were set (derived, part of equality and hash: the
    config is the policy cache's key); `dataclasses.replace` keeps it, since the defaults it
    copies still read as unset.
    """

    split_threshold: int = _DefaultInt(1024)
    split_align: int = 128
    split_offset: int = 0
    comm_ctas_attn: int = _DefaultInt(16)
    comm_ctas_mlp: int = _DefaultInt(16)
    comm_ctas_alone: int = _DefaultInt(64)
    max_tokens: int = 16384
    backend: Backend = "auto"
    comm: Comm = _DefaultStr("fused")
    defer_across_layers: bool = True
    fp8_rows: bool = True
    tuning_table: str = "auto"
    explicit: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "explicit", frozenset(
            name for name in TABLE_FIELDS
            if not isinstance(getattr(self, name), (_DefaultInt, _DefaultStr))))
        for name, low, high in _INT_RANGES:
            value = getattr(self, name)
            # bool is an int in Python; a JSON table's "64" is not: both are mistakes here.
            if isinstance(value, bool) or not isinstance(value, int) or not (
                    (low is None or low <= value) and (high is None or value <= high)):
                bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
                raise ValueError(f"{name} must be an int in {bounds}, got {value!r}")
        for name in ("defer_across_layers", "fp8_rows"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.comm not in COMMS:
            raise ValueError(f"comm must be one of {COMMS}, got {self.comm!r}")

    @classmethod
    def from_env(cls, base: TokenWeaveConfig | None = None) -> TokenWeaveConfig:
        """`base` with fields overridden by TOKENWEAVE_<FIELD> variables (TOKENWEAVE_BACKEND).
        A variable sets its field explicitly (it wins over the tuning table); the fields `base`
        left unset stay unset."""
        base = base or cls()
        changes: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(ENV_PREFIX + f.name.upper())
            if raw is None or not f.init:
                continue
            current = getattr(base, f.name)
            kind = bool if isinstance(current, bool) else int if isinstance(current, int) else str
            try:
                if kind is bool:
                    if raw.lower() not in ("0", "1", "true", "false"):
                        raise ValueError(raw)
                    changes[f.name] = raw.lower() in ("1", "true")
                else:
                    changes[f.name] = kind(raw)
            except ValueError:
                raise ValueError(
                    f"{ENV_PREFIX}{f.name.upper()}={raw!r} is not a valid {kind.__name__}"
                ) from None
        return dataclasses.replace(base, **changes)

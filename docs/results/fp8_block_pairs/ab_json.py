"""ab.sh's JSONs (fp8_rows_<build>_{0,1}.json in SRC) as one file in the schema of
fp8_rows_epilogue_ab_1gpu.json, its plot beside it, and the ranges printed. BASE: the build the
others' op times are compared with (ab.sh's checkout is "tree").

    python docs/results/fp8_block_pairs/ab_json.py SRC "GPU NAME" OUT.json "COMMAND" "WHAT" [BASE]
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend

from megatron_tokenweave.bench.report import dump_result, save_plot  # noqa: E402

KEEP = ("tp", "tokens", "hidden", "scaling", "ctas", "op_us", "fused_us", "cost")


def load(src: str, gpu: str) -> tuple[list[str], list[dict]]:
    """The builds (in file-name order) and every row, tagged with its build and pass."""
    rows, builds = [], []
    for path in sorted(glob.glob(f"{src}/fp8_rows_*_[01].json")):
        build, p = re.fullmatch(r"fp8_rows_(.+)_([01])\.json", os.path.basename(path)).groups()
        with open(path) as fh:
            d = json.load(fh)
        assert d["gpu"] == gpu, (d["gpu"], gpu)
        builds += [build] if build not in builds else []
        rows += [{"build": build, "pass": int(p), **{k: r[k] for k in KEEP}} for r in d["rows"]]
    return builds, rows


def pick(rows: list[dict], build: str, p: int, key: tuple, scaling: str, field: str) -> float:
    return next(r[field] for r in rows if r["build"] == build and r["pass"] == p
                and (r["tp"], r["hidden"], r["tokens"]) == key and r["scaling"] == scaling)


def plot(builds: list[str], base: str, rows: list[dict], gpu: str, date: str, path: str) -> None:
    keys = sorted({(r["tp"], r["hidden"], r["tokens"]) for r in rows})
    x = list(range(len(keys)))
    labels = [f"TP{t}\nH{h}\n{n}" for t, h, n in keys]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    bars = [(b, p) for b in builds for p in (0, 1)]
    width = 0.8 / len(bars)
    for ax, scaling in zip(axes[:2], ("blocks", "tensor"), strict=True):
        for i, (b, p) in enumerate(bars):
            ax.bar([xi + (i - (len(bars) - 1) / 2) * width for xi in x],
                   [100 * pick(rows, b, p, k, scaling, "cost") for k in keys], width,
                   label=f"{b} pass {p}")
        ax.axhline(3, color="red", ls="--", lw=1, label="goal: +3 %")
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("FP8 rows cost over bf16 rows (%)")
        ax.set_title(f"{scaling}: fused_us / op_us - 1")
        ax.legend(fontsize=6)
    ax = axes[2]
    others = [(b, p) for b in builds if b != base for p in (0, 1)]
    width = 0.8 / max(len(others), 1)
    top = 1.05
    for i, (b, p) in enumerate(others):
        ratio = [pick(rows, b, p, k, "tensor", "op_us") / pick(rows, base, p, k, "tensor", "op_us")
                 for k in keys]
        top = max(top, max(ratio) + 0.01)
        ax.bar([xi + (i - (len(others) - 1) / 2) * width for xi in x], ratio, width,
               label=f"{b} pass {p}")
    ax.axhline(1, color="k", lw=1)
    ax.set_ylim(0.85, top)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel(f"op_us build / {base} (bf16 rows)")
    ax.set_title(f"the op alone, against {base}")
    ax.legend(fontsize=6)
    fig.suptitle(f"Fused op writing FP8 rows, local part, 16 CTAs ({gpu}, {date})")
    fig.tight_layout()
    save_plot(fig, path, dpi=110)


def main() -> None:
    src, gpu, out, command, what = sys.argv[1:6]
    builds, rows = load(src, gpu)
    base = sys.argv[6] if len(sys.argv) > 6 else ("tree" if "tree" in builds else builds[0])
    with open(glob.glob(f"{src}/fp8_rows_*_0.json")[0]) as fh:
        date = json.load(fh)["date"]
    with open(out, "w") as fh:
        dump_result({"gpu": gpu, "date": date, "command": command, "what": what, "rows": rows},
                    fh)
    plot(builds, base, rows, gpu, date, out.removesuffix(".json") + ".png")
    for scaling in ("blocks", "tensor"):
        for b in builds:
            for tp in (2, 4):
                cs = [100 * r["cost"] for r in rows
                      if r["build"] == b and r["scaling"] == scaling and r["tp"] == tp]
                print(f"{scaling} {b} TP {tp}: {min(cs):+.1f} .. {max(cs):+.1f} %")


if __name__ == "__main__":
    main()

"""ab.sh's four JSONs (fp8_rows_{head,tree}_{0,1}.json in SRC) as one file in the schema of
fp8_rows_epilogue_ab_1gpu.json, its plot beside it, and the ranges printed.

    python docs/results/fp8_block_pairs/pairs_json.py SRC "GPU NAME" OUT.json "COMMAND" "WHAT"
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend

from megatron_tokenweave.bench.report import save_plot  # noqa: E402

BUILDS = ("head", "tree")


def load(src: str, gpu: str) -> list[dict]:
    rows = []
    for build in BUILDS:
        for p in (0, 1):
            with open(f"{src}/fp8_rows_{build}_{p}.json") as fh:
                d = json.load(fh)
            assert d["gpu"] == gpu, (d["gpu"], gpu)
            keep = ("tp", "tokens", "hidden", "scaling", "ctas", "op_us", "fused_us", "cost")
            rows += [{"build": build, "pass": p, **{k: r[k] for k in keep}} for r in d["rows"]]
    return rows


def pick(rows: list[dict], build: str, p: int, key: tuple, scaling: str, field: str) -> float:
    return next(r[field] for r in rows if r["build"] == build and r["pass"] == p
                and (r["tp"], r["hidden"], r["tokens"]) == key and r["scaling"] == scaling)


def plot(rows: list[dict], gpu: str, date: str, path: str) -> None:
    keys = sorted({(r["tp"], r["hidden"], r["tokens"]) for r in rows})
    x = list(range(len(keys)))
    labels = [f"TP{t}\nH{h}\n{n}" for t, h, n in keys]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    bars = (("head", 0, "tab:gray"), ("head", 1, "silver"),
            ("tree", 0, "tab:blue"), ("tree", 1, "lightskyblue"))
    for ax, scaling in zip(axes[:2], ("blocks", "tensor"), strict=True):
        for i, (b, p, c) in enumerate(bars):
            ax.bar([xi + (i - 1.5) * 0.2 for xi in x],
                   [100 * pick(rows, b, p, k, scaling, "cost") for k in keys], 0.2, color=c,
                   label=f"{b} pass {p}")
        ax.axhline(3, color="red", ls="--", lw=1, label="goal: +3 %")
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("FP8 rows cost over bf16 rows (%)")
        ax.set_title(f"{scaling}: fused_us / op_us - 1")
        ax.legend(fontsize=7)
    ax = axes[2]
    for p, c in ((0, "tab:blue"), (1, "lightskyblue")):
        ratio = [pick(rows, "tree", p, k, "tensor", "op_us")
                 / pick(rows, "head", p, k, "tensor", "op_us") for k in keys]
        ax.bar([xi + (p - 0.5) * 0.35 for xi in x], ratio, 0.35, color=c, label=f"pass {p}")
    ax.axhline(1, color="k", lw=1)
    ax.set_ylim(0.85, 1.05)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("op_us tree / head (bf16 rows)")
    ax.set_title("the op alone, tree against head")
    ax.legend(fontsize=7)
    fig.suptitle(f"Fused op writing FP8 rows, local part, 16 CTAs ({gpu}, {date})")
    fig.tight_layout()
    save_plot(fig, path, dpi=110)


def main() -> None:
    src, gpu, out, command, what = sys.argv[1:6]
    rows = load(src, gpu)
    with open(f"{src}/fp8_rows_tree_0.json") as fh:
        date = json.load(fh)["date"]
    with open(out, "w") as fh:
        json.dump({"gpu": gpu, "date": date, "command": command, "what": what, "rows": rows},
                  fh, indent=1)
    plot(rows, gpu, date, out.removesuffix(".json") + ".png")
    for scaling in ("blocks", "tensor"):
        for b in BUILDS:
            for tp in (2, 4):
                cs = [100 * r["cost"] for r in rows
                      if r["build"] == b and r["scaling"] == scaling and r["tp"] == tp]
                print(f"{scaling} {b} TP {tp}: {min(cs):+.1f} .. {max(cs):+.1f} %")


if __name__ == "__main__":
    main()

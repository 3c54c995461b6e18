"""ab.sh's JSONs (call_check_<build>.json in SRC) as one file, rows tagged with their build, and
its plot beside it (the check's cost per point and build, each pass's as a dot where the bench
ran several); the ranges printed.

    python docs/results/call_check/ab_json.py SRC OUT.json "COMMAND" "WHAT"
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


def load(src: str) -> tuple[str, str, list[str], list[dict]]:
    """The GPU, the date, the builds (tree first) and every row tagged with its build."""
    gpu = date = ""
    builds, rows = [], []
    for path in sorted(glob.glob(f"{src}/call_check_*.json"), key=lambda p: "tree" not in p):
        build = re.fullmatch(r"call_check_(.+)\.json", os.path.basename(path)).group(1)
        with open(path) as fh:
            d = json.load(fh)
        assert gpu in ("", d["gpu"]), (gpu, d["gpu"])
        gpu, date = d["gpu"], d["date"]
        builds.append(build)
        rows += [{"build": build, **r} for r in d["rows"]]
    return gpu, date, builds, rows


def main() -> None:
    src, out, command, what = sys.argv[1:5]
    gpu, date, builds, rows = load(src)
    with open(out, "w") as fh:
        dump_result({"gpu": gpu, "date": date, "command": command, "what": what, "rows": rows},
                    fh)
    keys = sorted({(r["tp"], r["hidden"], r["tokens"]) for r in rows})
    x = list(range(len(keys)))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(builds)
    for i, b in enumerate(builds):
        cost = {(r["tp"], r["hidden"], r["tokens"]): 100 * r["cost"] for r in rows
                if r["build"] == b}
        at = [xi + (i - (len(builds) - 1) / 2) * width for xi in x]
        ax.bar(at, [cost[k] for k in keys], width, label=b)
        passes = {(r["tp"], r["hidden"], r["tokens"]): r.get("costs", []) for r in rows
                  if r["build"] == b}  # every pass's cost where the bench ran several
        for xi, k in zip(at, keys, strict=True):
            ax.scatter([xi] * len(passes[k]), [100 * c for c in passes[k]], s=5, color="k")
        print(f"{b}: {min(cost.values()):+.2f} .. {max(cost.values()):+.2f} %")
    ax.axhline(2, color="red", ls="--", lw=1, label="goal: 2 %")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(x, [f"TP{t}\nH{h}\n{n}" for t, h, n in keys], fontsize=7)
    ax.set_ylabel("check on / check off - 1 (%)")
    ax.set_title(f"The one-shot path's call check, per build ({gpu}, {date})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, out.removesuffix(".json") + ".png", dpi=80)


if __name__ == "__main__":
    main()

"""The epilogue probe's JSONs (../fit_stages/ab.sh with this folder's patches:
ab_<build>_{0,1}.json in SRC, the tree and each other build) as one file, every row of cuBLAS
and the pick tagged with its build and pass, its plot beside it; printed per token count, over
the points whose pick is the fitted kernel: each other build's time of the pick over the tree's
(mean of the passes, each over cuBLAS in its own process), median, min and max: for a probe
build (no epilogue, no stores) the share of the kernel's time the part it leaves out costs, for
a variant (bulk stores) its time relative to the tree's.

    python docs/results/fit_epilogue/ab_json.py SRC OUT.json "COMMAND"
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend

from megatron_tokenweave.bench.report import dump_result, save_plot  # noqa: E402

KEPT = ("cublas", "tokenweave")


def load(src: str) -> tuple[dict, list[dict]]:
    """The tree's first file's header and every kept row, tagged with its build and pass."""
    rows, head = [], None
    for path in sorted(glob.glob(f"{src}/ab_*_[01].json")):
        build, p = re.fullmatch(r"ab_(.+)_([01])\.json", os.path.basename(path)).groups()
        with open(path) as fh:
            d = json.load(fh)
        if build == "tree" and p == "0":
            head = {k: v for k, v in d.items() if k != "rows"}
        rows += [{"build": build, "pass": int(p), **r} for r in d["rows"] if r["impl"] in KEPT]
    return head, rows


def shares(rows: list[dict]) -> dict[str, dict[tuple, float]]:
    """build -> (model, gemm, tp, tokens, dtype, tiles) -> the pick's time over the tree's (each
    over cuBLAS in its own process, the mean of the passes), where the pick is the fitted
    kernel."""
    t = defaultdict(dict)
    for r in rows:
        t[(r["build"], r["pass"], r["model"], r["gemm"], r["tp"], r["tokens"], r["dtype"],
           r["tiles"])][r["impl"]] = r["us"]
    rel = defaultdict(lambda: defaultdict(list))
    for (build, p, *point), us in t.items():
        tree = t.get(("tree", p, *point))
        if build == "tree" or tree is None or not point[-1].startswith("fit"):
            continue
        rel[build][tuple(point)].append(
            (us["tokenweave"] / us["cublas"]) / (tree["tokenweave"] / tree["cublas"]))
    return {b: {k: statistics.mean(v) for k, v in d.items()} for b, d in rel.items()}


def main() -> None:
    src, path, command = sys.argv[1:4]
    head, rows = load(src)
    got = shares(rows)
    fig, ax = plt.subplots(figsize=(7, 4))
    for build, points in sorted(got.items()):
        by_tokens = defaultdict(list)
        for key, v in points.items():
            by_tokens[key[3]].append(v)
        print(f"{build}: the pick's time / the tree's, per token count (median, min-max, points)")
        xs, med = [], []
        for n, vs in sorted(by_tokens.items()):
            vs.sort()
            print(f"  {n:5d}: {statistics.median(vs):.3f} ({vs[0]:.3f}-{vs[-1]:.3f}), {len(vs)}")
            xs.append(n)
            med.append(statistics.median(vs))
        ax.plot(xs, med, marker="o", label=build)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("time / the tree's (median over shards)")
    ax.set_title(f"the fitted kernel without a part of its epilogue ({head['gpu']})")
    ax.legend()
    with open(path, "w") as fh:
        dump_result({**head, "command": command, "rows": rows}, fh)
    save_plot(fig, path.removesuffix(".json") + ".png", 110)


if __name__ == "__main__":
    main()

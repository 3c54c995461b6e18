"""ab.sh's JSONs (ab_{tree,base}_{0,1}.json in SRC) as one file, every row the ratios read
tagged with its build and pass, its plot beside it, and per (tokens, cooperative extent) the
fitted kernel's speed in the tree over the base build printed: its cooperative mode where it
is the pick, else the one timed beside the pick (`tokenweave_fitted`), and its pairs (`c2`),
each over cuBLAS in the same process, the mean of the two passes.

    python docs/results/fit_stages/ab_json.py SRC OUT.json "COMMAND"
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend

from megatron_tokenweave.bench.report import dump_result, save_plot  # noqa: E402

BUILDS, PASSES = ("tree", "base"), (0, 1)
# The rows the ratios read (the file keeps only these, their tiles on the pick's rows, the
# dtypes once): cuBLAS, the pick, the fitted kernel timed beside a Triton pick, and the pairs
# (`...c2`).
KEPT = ("cublas", "tokenweave", "tokenweave_fitted")


def load(src: str) -> tuple[dict, list[dict]]:
    """The tree's first file's header and every row, tagged with its build and pass."""
    rows, head = [], None
    for build in BUILDS:
        for p in PASSES:
            with open(f"{src}/ab_{build}_{p}.json") as fh:
                d = json.load(fh)
            head = head or {k: v for k, v in d.items() if k != "rows"}
            rows += [{"build": build, "pass": p, **r} for r in d["rows"]]
    return head, rows


def _speed(x: dict, impl: str | None) -> float:
    """cuBLAS's time over impl's (None: the fitted cooperative tiles, picked or beside the pick)."""
    name = impl or ("tokenweave" if x["tokenweave"][1].startswith("fit") else "tokenweave_fitted")
    return x["cublas"][0] / x[name][0]


def ratios(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """(model, gemm, tp, tokens, extent) -> {"c": .., "c2": ..}: the tree's speed over the
    base's, each over cuBLAS in its own process, the mean over the passes."""
    times = defaultdict(dict)
    for r in rows:
        times[(r["model"], r["gemm"], r["tp"], r["tokens"], r["build"], r["pass"])][r["impl"]] = (
            r["us"], r["tiles"])
    out = defaultdict(lambda: defaultdict(list))
    for (m, g, tp, n, build, p), t in times.items():
        if build != "tree":
            continue
        pair = next((i for i in t if i.endswith("c2")), None)
        if pair is None:
            continue
        extent = int(pair.removeprefix("tokenweave_fit")[:-2])
        base = times[(m, g, tp, n, "base", p)]
        for mode, impl in (("c", None), ("c2", pair)):
            ratio = _speed(t, impl) / _speed(base, impl)
            out[(m, g, tp, n, extent)][mode].append(ratio)
    return {k: {mode: statistics.mean(v) for mode, v in d.items()} for k, d in out.items()}


def main() -> None:
    src, path, command = sys.argv[1:4]
    head, rows = load(src)
    r = ratios(rows)
    groups = defaultdict(list)
    for key, v in r.items():
        groups[(key[3], key[4])].append(v)
    print("tokens extent points: the cooperative mode's tree / base (median, min, max); pairs'")
    for (n, extent), vs in sorted(groups.items()):
        c = sorted(v["c"] for v in vs)
        print(f"{n:6d} {extent:4d} {len(c):3d}  {statistics.median(c):.3f} {c[0]:.3f} {c[-1]:.3f}"
              f"   {statistics.median(v['c2'] for v in vs):.3f}")
    dtypes = sorted({x["dtype"] for x in rows})
    kept = [{k: v for k, v in x.items()
             if k != "dtype" and (k != "tiles" or x["impl"] == "tokenweave")}
            for x in rows if x["impl"] in KEPT or x["impl"].endswith("c2")]
    with open(path, "w") as fh:
        dump_result({**head, "command": command, "dtypes": dtypes, "rows": kept}, fh)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for label, lo, hi in (("136-160 tokens (half passes)", 136, 160),
                          ("168-176 tokens (one buffer)", 168, 176), ("other extents", 0, 128)):
        pts = [(k[3], v["c"]) for k, v in r.items() if lo <= k[4] <= hi]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=label, s=14)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("tokens (replicated layout)")
    ax.set_ylabel("fitted cooperative kernel: tree / base speed\n(each over cuBLAS)")
    ax.set_title(f"Epilogue staging for a fourth stage, {head['gpu']} ({head['date']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, path.removesuffix(".json") + ".png", 110)


if __name__ == "__main__":
    main()

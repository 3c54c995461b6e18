"""`bench gemm_fused` results of several processes (one per model or dtype, so a device call cut
short keeps what finished) as one file of the same schema, its plot beside it (bench
gemm_fused's; for a file of at most two token counts that timed both cooperative extent
bounds, the fitted kernel's speed with each, a point a shard); printed per dtype and token
count: the pick's speed over cuBLAS (median, min, points at or above 0.98x), and where the
fitted kernel's cooperative tiles were timed with both extent bounds beside each other
(`tokenweave_wide` / `tokenweave_narrow`), the wide tiles' speed over the narrow ones (the
mean over passes).

    python docs/results/gemm_join.py OUT.json "COMMAND" SRC.json... [--gemm-from-order]

--gemm-from-order: take each row's `gemm` from its place in its file, not its field: within a
(model, TP, tokens, dtype) the bench writes o_proj's rows, then fc2's, each impl once a pass, so
the first repeat of an (impl, pass) starts fc2's (for files whose field was written wrong).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

from megatron_tokenweave.bench.gemm_fused import _plot
from megatron_tokenweave.bench.report import dump_result


def gemm_from_order(rows: list[dict]) -> None:
    """Set each row's gemm from its order within its point (see the module's docstring)."""
    seen: dict[tuple, set] = defaultdict(set)
    second: set[tuple] = set()
    for r in rows:
        point = (r["model"], r["tp"], r["tokens"], r["dtype"])
        key = (r["impl"], r["pass"])
        if point not in second and key in seen[point]:
            second.add(point)
        seen[point].add(key)
        r["gemm"] = "fc2" if point in second else "o_proj"
    tiles = defaultdict(set)
    for r in rows:
        tiles[(r["model"], r["tp"], r["tokens"], r["dtype"], r["gemm"])].add(r["tiles"])
    if any(len(t) != 1 for t in tiles.values()) or len(tiles) != 2 * len(seen):
        raise SystemExit("rows do not split into o_proj's then fc2's at every point")


def bounds(rows: list[dict]) -> tuple[dict, dict]:
    """Per point (dtype, tokens, model, gemm, TP): the pick's speed over cuBLAS, and where both
    were timed, (narrow, wide): the fitted kernel's speed over cuBLAS with each extent bound
    (the pick's or the one beside it, and `tokenweave_wide` / `tokenweave_narrow`); means
    over passes."""
    us = defaultdict(lambda: defaultdict(list))
    for r in rows:
        point = (r["dtype"], r["tokens"], r["model"], r["gemm"], r["tp"], r["tiles"])
        us[point][r["impl"]].append(r["us"])
    pick, both = {}, {}
    for (*where, tiles), t in us.items():
        m = {i: statistics.mean(v) for i, v in t.items()}
        point = tuple(where)
        pick[point] = m["cublas"] / m["tokenweave"]
        fitted = "tokenweave" if tiles.startswith("fit") else "tokenweave_fitted"
        if "tokenweave_wide" in m:
            both[point] = (m["cublas"] / m[fitted], m["cublas"] / m["tokenweave_wide"])
        elif "tokenweave_narrow" in m:
            both[point] = (m["cublas"] / m["tokenweave_narrow"], m["cublas"] / m[fitted])
    return pick, both


def plot_bounds(both: dict, gpu: str, path: str) -> None:
    """The wide tiles' speed against the narrow ones' over cuBLAS, a point a shard and count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_tokenweave.bench.report import save_plot

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for (dtype, tokens), marker in zip(sorted({k[:2] for k in both}), "os^vD<>", strict=False):
        xy = [v for k, v in both.items() if k[:2] == (dtype, tokens)]
        ax.scatter(*zip(*xy, strict=True), marker=marker, s=18, label=f"{dtype} {tokens}")
    lo = min(min(v) for v in both.values()) - 0.02
    ax.plot([lo, 1.1], [lo, 1.1], color="gray", lw=0.8)
    ax.set_xlabel("cooperative extents to 176 (128-row consumers): cuBLAS time / ours")
    ax.set_ylabel("to 208 (64-row consumers past 176): cuBLAS time / ours")
    ax.set_title(f"the fitted kernel's two extent bounds, {gpu}", fontsize=9)
    ax.legend(fontsize=7)
    save_plot(fig, path, 110)


def summary(pick: dict, both: dict) -> None:
    """Print the pick's speed per (dtype, tokens) and the wide tiles' over the narrow ones."""
    per, wide = defaultdict(list), defaultdict(list)
    for k, v in pick.items():
        per[k[:2]].append(v)
    for k, (narrow, w) in both.items():
        wide[k[:2]].append(w / narrow)
    print("dtype tokens: the pick over cuBLAS median (min), points >= 0.98x")
    for key, v in sorted(per.items()):
        print(f"  {key[0]} {key[1]:5d}: {statistics.median(v):.3f} ({min(v):.3f}), "
              f"{sum(x >= 0.98 for x in v)}/{len(v)}")
    if wide:
        print("dtype tokens: the wide cooperative tiles over the narrow ones, median (min-max)")
    for key, v in sorted(wide.items()):
        print(f"  {key[0]} {key[1]:5d}: {statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f}),"
              f" {len(v)} points")


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--gemm-from-order"]
    out, command, sources = args[0], args[1], args[2:]
    head, rows = None, []
    for src in sources:
        with open(src) as fh:
            d = json.load(fh)
        head = head or {k: v for k, v in d.items() if k not in ("command", "rows")}
        mine = d["rows"]
        if "--gemm-from-order" in sys.argv:
            gemm_from_order(mine)
        rows += mine
    result = {**head, "command": command, "rows": rows}
    with open(out, "w") as fh:
        dump_result(result, fh)
    pick, both = bounds(rows)
    # a sweep: bench gemm_fused's plot; the two bounds timed at a few counts: both, a point each
    if len({k[1] for k in pick}) <= 2 and both:
        plot_bounds(both, head["gpu"], out.removesuffix(".json") + ".png")
    else:
        _plot(result, out.removesuffix(".json") + ".png")
    summary(pick, both)


if __name__ == "__main__":
    main()

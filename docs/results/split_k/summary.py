"""run.sh's per-model JSONs (bench gemm_fused with split K's rows beside the pick) as one file,
its plot beside it; printed: per point cuBLAS over the pick, over split K's tiles without it
(`tokenweave_split_none`) and over each split region (`tokenweave_split_<region>`), and the
fastest region's speed over its tiles without split K; per K steps of a tile (the fixed cost of
the sums weighs less over more steps) and per wave efficiency of split K's tiles without it, the
median of that speed-up; the points at or above 0.98x of cuBLAS with the pick and with the
fastest of the pick and the split rows (what a rule choosing between them could reach at best):
the data a pick rule is fitted to.

    python docs/results/split_k/summary.py SRC OUT.json "COMMAND"
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend

from megatron_tokenweave.bench.gemm_fused import GEMMS  # noqa: E402
from megatron_tokenweave.bench.report import dump_result, save_plot  # noqa: E402
from megatron_tokenweave.bench.split_cost import layer_gemms  # noqa: E402
from megatron_tokenweave.models import SHAPES  # noqa: E402
from megatron_tokenweave.ops.segments import (  # noqa: E402
    SPLIT_REGIONS,
    split_k_tiles,
    wave_efficiency,
)
from megatron_tokenweave.ops.validate import Layout  # noqa: E402

SPLITS = tuple(f"tokenweave_split_{r}" for r in SPLIT_REGIONS)
KEPT = ("cublas", "tokenweave", "tokenweave_split_none", *SPLITS, "tokenweave_split_fitted")
CTAS = 132  # an H200's and an H100 SXM's SMs
# A row's fields kept (the bench's dtype, pass and tile label left out: the committed results
# travel with the working tree, tests/test_checkout_size.py); the dtypes go in the header.
FIELDS = ("model", "gemm", "tp", "tokens", "impl", "us")


def points(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """(model, gemm, tp, tokens) -> impl -> median time."""
    t = defaultdict(lambda: defaultdict(list))
    for r in rows:
        t[(r["model"], r["gemm"], r["tp"], r["tokens"])][r["impl"]].append(r["us"])
    return {k: {i: statistics.median(u) for i, u in v.items()} for k, v in t.items()}


def split_shape(model: str, gemm: str, tp: int, tokens: int) -> tuple[float, int]:
    """The wave efficiency of split K's tiles without it, and a tile's K steps."""
    k, n = layer_gemms(SHAPES[model], tp)[GEMMS[gemm]]
    t = split_k_tiles(Layout.REPLICATED, tp, tokens, n, k, CTAS)
    return wave_efficiency(t, Layout.REPLICATED, tp, tokens, n, CTAS), -(-k // t.block_k)


def main() -> None:
    src, path, command = sys.argv[1:4]
    rows, head, dtypes = [], None, set()
    for f in sorted(glob.glob(f"{src}/*.json")):
        with open(f) as fh:
            d = json.load(fh)
        head = head or {k: v for k, v in d.items() if k != "rows"}
        kept = [r for r in d["rows"] if r["impl"] in KEPT]
        dtypes |= {r.get("dtype", "bf16") for r in kept}
        rows += [{k: r[k] for k in FIELDS} for r in kept]
    got = {k: v for k, v in points(rows).items() if "tokenweave_split_none" in v}
    by_steps, by_eff, wins = defaultdict(list), defaultdict(list), defaultdict(int)
    pick_ok = best_ok = 0
    fig, ax = plt.subplots(figsize=(7, 4))
    for (m, g, tp, n), us in sorted(got.items()):
        eff, steps = split_shape(m, g, tp, n)
        best = min((i for i in SPLITS if i in us), key=us.get)
        gain = us["tokenweave_split_none"] / us[best]
        wins[best] += 1
        ax.scatter(eff, gain, s=10 + steps / 4, c="C0" if g == "fc2" else "C1", alpha=0.6)
        by_steps[min(steps // 32 * 32, 224)].append(gain)
        by_eff[round(min(eff, 0.999) * 20) / 20].append(gain)
        ratios = {i: us["cublas"] / us[i] for i in KEPT[1:] if i in us}
        pick_ok += ratios["tokenweave"] >= 0.98
        best_ok += max(ratios.values()) >= 0.98
        print(f"{m:14s} {g:6s} TP{tp} {n:5d}  pick {ratios['tokenweave']:.3f}  "
              + "  ".join(f"{i.removeprefix('tokenweave_split_')} {r:.3f}"
                          for i, r in ratios.items() if i != "tokenweave")
              + f"  best/none {gain:.3f}  (wave efficiency {eff:.2f}, {steps} K steps)")
    for name, groups in (("K steps of a tile", by_steps), ("the tiles' wave efficiency", by_eff)):
        print(f"the fastest split's speed over its tiles without it by {name}: median (min-max, "
              f"points)")
        for key, v in sorted(groups.items()):
            v.sort()
            print(f"  {key}: {statistics.median(v):.3f} ({v[0]:.3f}-{v[-1]:.3f}, {len(v)})")
    print(f"fastest region: {dict(wins)}")
    print(f"at or above 0.98x of cuBLAS: the pick {pick_ok}, the fastest of the pick and the "
          f"split rows {best_ok}, of {len(got)}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("wave efficiency of split K's tiles without it")
    ax.set_ylabel("fastest split / the same tiles unsplit")
    ax.set_title(f"split K beside its tiles unsplit (fc2 blue, o_proj orange; size: K steps; "
                 f"{head['gpu']})", fontsize=9)
    with open(path, "w") as fh:
        dump_result({**head, "command": command, "dtype": " ".join(sorted(dtypes)),
                     "rows": rows}, fh)
    save_plot(fig, path.removesuffix(".json") + ".png", 110)


if __name__ == "__main__":
    main()

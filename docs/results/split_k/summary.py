"""run.sh's per-model JSONs (bench gemm_fused with `tokenweave_split` beside the pick) as one
file, its plot beside it; printed: per point cuBLAS over the pick and over split K, and split
K's speed over the pick's; per K steps of a tile (the fixed cost of its sums weighs less over
more steps) and per wave efficiency of the tiles the pick runs, the median of split K over the
pick; the points at or above 0.98x of cuBLAS with the pick and with the faster of the two (what
a rule choosing between them could reach at best): the data a pick rule is fitted to.

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
from megatron_tokenweave.ops.segments import fitted_tiles, tiles_for, wave_efficiency  # noqa: E402
from megatron_tokenweave.ops.validate import Layout  # noqa: E402

KEPT = ("cublas", "tokenweave", "tokenweave_split")
CTAS = 132  # an H200's and an H100 SXM's SMs


def points(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """(model, gemm, tp, tokens) -> impl -> median time."""
    t = defaultdict(lambda: defaultdict(list))
    for r in rows:
        t[(r["model"], r["gemm"], r["tp"], r["tokens"])][r["impl"]].append(r["us"])
    return {k: {i: statistics.median(u) for i, u in v.items()} for k, v in t.items()}


def pick_efficiency(model: str, gemm: str, tp: int, tokens: int) -> tuple[float, int]:
    """The wave efficiency of the tiles the pick runs (the fitted ones where it takes them) and
    a tile's K steps."""
    k, n = layer_gemms(SHAPES[model], tp)[GEMMS[gemm]]
    t = tiles_for(Layout.REPLICATED, tp, tokens, n, k, CTAS, fitted=True)
    if t.fitted:
        t = fitted_tiles(Layout.REPLICATED, tp, tokens, n, CTAS)
    return wave_efficiency(t, Layout.REPLICATED, tp, tokens, n, CTAS), -(-k // t.block_k)


def main() -> None:
    src, path, command = sys.argv[1:4]
    rows, head = [], None
    for f in sorted(glob.glob(f"{src}/*.json")):
        with open(f) as fh:
            d = json.load(fh)
        head = head or {k: v for k, v in d.items() if k != "rows"}
        rows += [r for r in d["rows"] if r["impl"] in KEPT]
    got = {k: v for k, v in points(rows).items() if "tokenweave_split" in v}
    by_steps, by_eff, pick_ok, best_ok = defaultdict(list), defaultdict(list), 0, 0
    fig, ax = plt.subplots(figsize=(7, 4))
    for (m, g, tp, n), us in sorted(got.items()):
        pick, split = us["cublas"] / us["tokenweave"], us["cublas"] / us["tokenweave_split"]
        eff, steps = pick_efficiency(m, g, tp, n)
        gain = us["tokenweave"] / us["tokenweave_split"]
        ax.scatter(eff, gain, s=10 + steps / 4, c="C0" if g == "fc2" else "C1", alpha=0.6)
        by_steps[min(steps // 32 * 32, 224)].append(gain)
        by_eff[round(min(eff, 0.999) * 20) / 20].append(gain)
        pick_ok += pick >= 0.98
        best_ok += max(pick, split) >= 0.98
        print(f"{m:14s} {g:6s} TP{tp} {n:5d}  pick {pick:.3f}  split {split:.3f}  "
              f"split/pick {gain:.3f}  (pick's wave efficiency {eff:.2f}, {steps} K steps)")
    for name, groups in (("K steps of a tile", by_steps), ("the pick's wave efficiency", by_eff)):
        print(f"split K's speed over the pick's by {name}: median (min-max, points)")
        for key, v in sorted(groups.items()):
            v.sort()
            print(f"  {key}: {statistics.median(v):.3f} ({v[0]:.3f}-{v[-1]:.3f}, {len(v)})")
    print(f"at or above 0.98x of cuBLAS: the pick {pick_ok}, the faster of the two {best_ok}, "
          f"of {len(got)}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("wave efficiency of the pick's tiles")
    ax.set_ylabel("split K's speed / the pick's")
    ax.set_title(f"split K beside the pick (fc2 blue, o_proj orange; size: K steps; "
                 f"{head['gpu']})", fontsize=9)
    with open(path, "w") as fh:
        dump_result({**head, "command": command, "rows": rows}, fh)
    save_plot(fig, path.removesuffix(".json") + ".png", 110)


if __name__ == "__main__":
    main()

"""The result file every benchmark writes: {"gpu", "date", "command", "rows", ...} + a plot."""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Callable
from typing import Any

import torch


def dump_result(result: dict, fh: Any) -> None:
    """A result as JSON: its fields indented, each element of a list of rows on a line of its
    own (about a third fewer bytes than indenting every field: the committed results travel with
    the working tree to the device machine, `tests/test_checkout_size.py`)."""
    parts = []
    for key, value in result.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            body = ",\n".join("  " + json.dumps(v) for v in value)
            parts.append(f" {json.dumps(key)}: [\n{body}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: " + json.dumps(value, indent=1).replace("\n", "\n "))
    fh.write("{\n" + ",\n".join(parts) + "\n}\n")


def write_result(name: str, argv: list[str] | None, rows: list[dict], out: str,
                 plot: Callable[[dict, str], None], **extra: Any) -> dict:
    """Write `out` (JSON) and the plot next to it (same name, .png); return the result."""
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "date": datetime.date.today().isoformat(),
        "command": f"python -m megatron_tokenweave.bench {name} "
        + " ".join(sys.argv[2:] if argv is None else argv),
        **extra,
        "rows": rows,
    }
    with open(out, "w") as f:
        dump_result(result, f)
    plot(result, out.replace(".json", ".png"))
    print(f"wrote {out}")
    return result


def save_plot(fig: Any, path: str, dpi: int) -> None:
    """Save a figure as a PNG of 256 colours: about a third of matplotlib's RGBA bytes for these
    line and bar plots. The committed results travel with the working tree to the device
    machine, whose 64 MiB a call must also hold a 55 MiB part of TE's wheel."""
    import io

    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=256).save(path, optimize=True)


def grouped_bars(ax: Any, groups: list, series: dict[str, list[float]],
                 value_labels: bool = False) -> None:
    """One group of bars per entry of `groups` (x tick labels), one bar per series in each
    group, in the order of `series`; `value_labels` writes each bar's value on it."""
    width = 0.8 / max(len(series), 1)
    for k, (label, values) in enumerate(series.items()):
        bars = ax.bar([x + k * width for x in range(len(groups))], values, width, label=label)
        if value_labels:
            ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(groups))],
                  [str(g) for g in groups])

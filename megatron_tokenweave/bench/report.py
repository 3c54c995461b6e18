"""The result file every benchmark writes: {"gpu", "date", "command", "rows", ...} + a plot."""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Callable
from typing import Any

import torch


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
        json.dump(result, f, indent=1)
    plot(result, out.replace(".json", ".png"))
    print(f"wrote {out}")
    return result

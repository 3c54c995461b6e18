"""`python -m megatron_tokenweave.bench NAME ...` runs megatron_tokenweave.bench.NAME.main."""

from __future__ import annotations

import importlib
import sys

NAMES = ("kernel", "block", "timeline", "e2e", "split_cost")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in NAMES:
        raise SystemExit(f"usage: python -m megatron_tokenweave.bench {{{','.join(NAMES)}}} [...]")
    module = importlib.import_module(f"megatron_tokenweave.bench.{sys.argv[1]}")
    module.main(sys.argv[2:])


if __name__ == "__main__":
    main()

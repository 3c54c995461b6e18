"""Log a message once per (logger, key): fallbacks are announced, not repeated every layer."""

from __future__ import annotations

import logging

logger = logging.getLogger("megatron_tokenweave")
_seen: set[str] = set()


def log_once(key: str, message: str, level: int = logging.WARNING) -> None:
    """Emit `message` the first time `key` is seen in this process."""
    if key in _seen:
        return
    _seen.add(key)
    logger.log(level, message)

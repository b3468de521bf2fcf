"""Warnings said once per process: a slower path taken again and again is worth one line, not one
per call."""

from __future__ import annotations

import logging
from typing import Any, Hashable

__all__ = ["warn_once"]

log = logging.getLogger("tiledmlp")
_SAID: set[Hashable] = set()  # keys of the warnings already logged


def warn_once(key: Hashable, message: str, *args: Any) -> None:
    """``log.warning(message, *args)`` the first time ``key`` is seen in this process."""
    if key not in _SAID:
        _SAID.add(key)
        log.warning(message, *args)

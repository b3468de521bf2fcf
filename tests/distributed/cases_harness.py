"""Cases of the harness's own test (``test_harness.py``), never part of a suite: ranks that outlive their launcher
unless the harness ends them."""

from __future__ import annotations

import time
from typing import Any

from .common import Env, registry

CASES, case = registry()


@case
def sleeps(env: Env) -> dict[str, Any]:
    """Every rank waits far longer than the test does: only a kill ends it."""
    time.sleep(600)
    return {}

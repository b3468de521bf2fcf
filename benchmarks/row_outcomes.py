"""How each row of a multi-rank benchmark ended on every rank, so that no rank waits forever for one that ran out of
memory (``bench_sp.py``).

A rank that runs out of memory inside a step leaves the others blocked in a collective it will never join (the
all-to-all of the next layer, say): nothing sent through that process group reaches them. So the outcome of each row
travels out of band, through the c10d key-value store every rank already talks to (torchrun's, or rank 0's), and:

* every rank posts ``ok`` or ``oom`` for the row when it leaves it, then waits for every rank's post (at most
  ``grace_s``): all posted — every rank is out of the row, the process group is usable — and the row counts as out of
  memory if any rank was, on every rank;
* a rank still inside the row ``grace_s`` after another posted ``oom`` is blocked in a collective: a watchdog thread
  calls ``on_stuck`` (rank 0: write the row as out of memory) and ends the process, and torchrun ends the others;
* a rank that posted but does not hear from every rank within twice ``grace_s`` does the same (the blocked ranks'
  watchdogs end first).

No rank waits much longer than ``grace_s`` past the first out-of-memory error; a run that completes costs a few store
round trips per rank and row.
"""

from __future__ import annotations

import datetime
import os
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["RowOutcomes"]


class RowOutcomes:
    """Rows run through :meth:`run` on every rank, in the same order."""

    def __init__(self, grace_s: float = 60.0, prefix: str = "tiledmlp-bench-rows") -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.grace_s = grace_s
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=datetime.timedelta(seconds=grace_s))
        self.store = dist.PrefixStore(prefix, client)
        self.row = 0

    def _keys(self, row: int) -> list[str]:
        return [f"{row}/{r}" for r in range(self.world)]

    def run(self, fn: Callable[[], Any], on_stuck: Callable[[str], None]) -> tuple[Optional[Any], str]:
        """``(fn()'s result or None, "ok" or "oom")``, the outcome agreed by every rank. ``on_stuck(why)`` runs before
        the process ends when a rank is blocked in a collective."""
        row, self.row = self.row, self.row + 1
        left = threading.Event()
        watchdog = threading.Thread(target=self._watch, args=(row, left, on_stuck), daemon=True)
        watchdog.start()
        try:
            result, status = fn(), "ok"
        except torch.OutOfMemoryError:
            result, status = None, "oom"
        left.set()
        watchdog.join()
        if status == "oom" and torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.store.set(f"{row}/{self.rank}", status)
        # Twice the grace time: a blocked rank's watchdog gives up first, and rank 0's writes the row as it does.
        try:
            self.store.wait(self._keys(row), datetime.timedelta(seconds=2 * self.grace_s))
        except RuntimeError:  # the store's timeout: a rank that has not left the row is blocked in a collective
            missing = [r for r, key in enumerate(self._keys(row)) if not self.store.check([key])]
            self._give_up(on_stuck, f"rank {self.rank} left the row ({status}); ranks {missing} had not after "
                                    f"{2 * self.grace_s:.0f} s")
        statuses = [self.store.get(key).decode() for key in self._keys(row)]
        return (None, "oom") if "oom" in statuses else (result, "ok")

    def _watch(self, row: int, left: threading.Event, on_stuck: Callable[[str], None]) -> None:
        """Runs while this rank is inside ``row`` (``left`` is set when it leaves): once another rank posted ``oom``,
        this one has ``grace_s`` to leave."""
        others = [(r, key) for r, key in enumerate(self._keys(row)) if r != self.rank]
        while not left.wait(0.5):
            failed = [r for r, key in others if self.store.check([key]) and self.store.get(key) == b"oom"]
            if failed:
                if not left.wait(self.grace_s):
                    self._give_up(on_stuck, f"rank {failed[0]} ran out of memory; rank {self.rank} is blocked in a "
                                            "collective it will not join")
                return

    @staticmethod
    def _give_up(on_stuck: Callable[[str], None], why: str) -> None:
        """Say why, then end this process (torchrun ends the other ranks): its process group cannot be used again."""
        on_stuck(why)
        os._exit(3)

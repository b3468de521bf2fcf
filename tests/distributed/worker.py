"""torchrun entry point of the distributed suite: every rank runs the named cases of one launch of the matrix
(``matrix:<launch>``, ``matrix.py``) or of one cases module (its ``CASES``).

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        tests/distributed/worker.py matrix:LAUNCH|CASES_MODULE OUT_DIR [CASE ...]

After each case every rank rewrites ``OUT_DIR/rank<r>.json`` with ``{case: {"status": "ok" | "error" |
"not_run", "metrics" | "traceback" | "reason": ..., "seconds": ...}}``, so results survive a
later crash or hang. Ranks then exchange their statuses on a separate gloo group; after an error on any
rank the remaining cases are not run (a rank that failed mid-collective leaves the others' process
group unusable), and each is reported as not run, naming the case that failed.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

# The suite's modules are the package tests.distributed, as pytest imports them: the checkout's root on the path, and
# not this folder (its modules' names would hide any library's of the same name).
sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from tests.distributed.common import CaseFn, Env, init_env  # noqa: E402

#: per-collective timeout: a rank waiting on a failed peer gives up after this long
COLLECTIVE_TIMEOUT_S = float(os.environ.get("TILEDMLP_TEST_COLLECTIVE_TIMEOUT", "60"))


def _run_one(case: CaseFn, env: Env) -> dict[str, Any]:
    try:
        return {"status": "ok", "metrics": case(env)}
    except BaseException:  # noqa: BLE001 — the rank's traceback is the report
        return {"status": "error", "traceback": traceback.format_exc()}


def main() -> None:
    what, out_dir, *names = sys.argv[1:]
    env = init_env(COLLECTIVE_TIMEOUT_S)
    module_name, _, launch = what.partition(":")
    module = importlib.import_module(f"tests.distributed.{module_name}")
    cases: dict[str, CaseFn] = module.cases(launch) if launch else module.CASES
    unknown = [n for n in names if n not in cases]
    if unknown:
        raise SystemExit(f"unknown cases {unknown} in {what}; known: {sorted(cases)}")
    control = dist.new_group(backend="gloo")  # statuses travel here even when NCCL is broken
    out = Path(out_dir) / f"rank{env.rank}.json"
    results: dict[str, Any] = {}
    selected = names or list(cases)
    for i, name in enumerate(selected):
        start = time.perf_counter()
        results[name] = _run_one(cases[name], env)
        results[name]["seconds"] = round(time.perf_counter() - start, 3)
        out.write_text(json.dumps(results, indent=1))
        statuses: list[Any] = [None] * env.world
        dist.all_gather_object(statuses, results[name]["status"], group=control)
        failed = [r for r, s in enumerate(statuses) if s == "error"]
        if failed:
            for rest in selected[i + 1:]:
                results[rest] = {"status": "not_run", "reason": f"case {name!r} failed on ranks {failed} first"}
            out.write_text(json.dumps(results, indent=1))
            break
    # The last case's wrapper sits in reference cycles holding the group: free it before the group,
    # so Gloo's threads are not torn down during interpreter finalization (an intermittent abort).
    gc.collect()
    dist.barrier(group=control)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Tensor-parallel cases on 4 processes, run by ``worker.py``: TP=4 over the world, and torchtitan's 2-D
form, FSDP2 over TP (DP=2 x TP=2), in fp32 and with FSDP2's bf16 mixed precision."""

from __future__ import annotations

from cases_tp import (fsdp2_over_tp, fsdp2_over_tp_bf16, tp_collectives_per_call, tp_replicated,
                      tp_sequence_parallel)
from common import registry

CASES, case = registry()

for _fn in (tp_sequence_parallel, tp_replicated, tp_collectives_per_call, fsdp2_over_tp, fsdp2_over_tp_bf16):
    case(_fn)

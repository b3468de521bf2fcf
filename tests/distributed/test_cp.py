"""torch's ring context parallelism (cases in ``cases_cp.py``): FSDP2 over a ``dp_shard x cp`` mesh, a Llama with
grouped KV heads repeated by ``tiledmlp.repeat_kv_heads``, contiguous and load-balanced chunks, trained untiled and
tiled like one process on the whole sequences. GPUs only: torch's SDPA ring has no CPU kernels (on the CPU,
``test_sp.py`` checks the ``cp`` mesh's naming and refusals)."""

from __future__ import annotations

import pytest
import torch

from .harness import assert_all_checked, launch

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="torch's ring attention runs on CUDA only: "
                                 "needs 2 GPUs (launch/run_distributed_tests.sh 2 on a GPU machine)")]
CASES = ("cp_fsdp2", "cp_fsdp2_load_balanced")
TRAINER = "trainer_cp"
TOL = 1e-4  # the ring's efficient-attention kernel against the reference's eager attention, float32


@pytest.fixture(scope="module", params=[2, 4], ids=["2proc", "4proc"])
def suite(request):
    if torch.cuda.device_count() < request.param:
        pytest.skip(f"needs {request.param} GPUs")
    return launch("cases_cp", nproc=request.param)


@pytest.mark.parametrize("case", CASES)
def test_trains_like_one_process_on_the_whole_sequence(suite, case):
    for m in suite.metrics(case):
        assert m["strategies"] == ["fsdp2+cp"], m
        assert m["untiled_vs_reference"] <= TOL < m["moved"], m
        assert m["tiled_vs_untiled"] <= TOL and m["tiled_vs_reference"] <= TOL, m


def test_trainer_with_cp_size_trains_as_untiled(suite):
    """``Trainer`` + ``ParallelismConfig(cp_size=world)``: the tiled model's loss and parameters are the untiled
    model's under the same Trainer (how the Trainer weighs the ranks' losses is its own: docs/sequence-parallel.md)."""
    for m in suite.metrics(TRAINER):
        untiled, tiled = m["losses"]
        assert abs(tiled - untiled) <= 1e-5 * abs(untiled), m
        assert m["tiled_vs_untiled"] <= TOL < m["moved"], m
        assert m["strategies"] == ["fsdp2+cp"], m


def test_every_case_checked(suite):
    assert_all_checked(suite, set(CASES) | {TRAINER})

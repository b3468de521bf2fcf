"""Hugging Face models under torchrun (cases in ``cases_hf.py``): Llama, Mixtral (MoE), PEFT-LoRA."""

from __future__ import annotations

import pytest

from .harness import assert_all_checked, assert_matches_untiled, launch

pytestmark = pytest.mark.distributed

CASES = {
    "hf_llama_ddp": "ddp",
    "hf_llama_fsdp2": "fsdp2",
    "hf_llama_fsdp1_flat": "fsdp1",
    "hf_mixtral_ddp": "ddp",
    "hf_mixtral_fsdp2": "fsdp2",
    "hf_peft_lora_ddp": "ddp",
    "hf_peft_lora_ddp_tile_before_wrap": "ddp",
}


@pytest.fixture(scope="module")
def suite():
    return launch("cases_hf")


@pytest.mark.parametrize("case", list(CASES))
def test_matches_untiled(suite, case):
    assert_matches_untiled(suite.metrics(case), CASES[case])


def test_every_case_checked(suite):
    assert_all_checked(suite, set(CASES))

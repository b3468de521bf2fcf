"""The memory model (``tiledmlp.plan``) against the peaks measured on a GPU, read from the benchmark results (no
number is copied here), and its terms on models built on the meta device (nothing allocated)."""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import pytest
import torch

import tiledmlp
from tiledmlp.plan.memory import GPU, HOST, RECOMPUTE, arrange

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_longctx  # noqa: E402

#: one H100 80GB, Llama-3.1-8B shape, bf16, loss + norms + offload to the host, with and without attention=True
MEASURED = sorted((ROOT / "benchmarks" / "results").glob("bench_longctx_nvidia-h100-80gb-hbm3_8b_attn_*.csv"))


def meta_model(size: str, layers: int) -> torch.nn.Module:
    return bench_longctx.build_model(dict(bench_longctx.MODELS[size], layers=layers), 1 << 20, torch.device("meta"),
                                     torch.bfloat16)


def measured_rows():
    rows = []
    for path in MEASURED:
        layers = int(re.search(r"_(\d+)l", path.name).group(1))
        rows += [(layers, row) for row in csv.DictReader(path.open())]
    return rows


def test_the_model_meets_every_measured_peak_within_5_percent():
    rows = measured_rows()
    assert len({(layers, row["T"], row["variant"]) for layers, row in rows}) >= 6, [p.name for p in MEASURED]
    models = {}
    for layers, row in rows:
        model = models.setdefault(layers, meta_model("8b", layers))
        parts = set(row["variant"].split("+"))
        plan = tiledmlp.plan_memory(model, int(row["T"]), loss="loss" in parts, norms="norms" in parts,
                                    attention="attn" in parts, offload="cpu" if "offload" in parts else None,
                                    gpu_mib=1 << 30, host_mib=1 << 30)
        measured = float(row["peak_gib"]) * 2**30
        assert abs(plan.gpu_peak_bytes / measured - 1) <= 0.05, (layers, row["variant"], row["T"], plan.table())
        assert plan.host_peak_bytes == layers * int(row["T"]) * 4096 * 2  # every layer's input, pinned


def test_terms_of_the_8b_shape():
    model = meta_model("8b", 4)
    plan = tiledmlp.plan_memory(model, 131072, norms=True, attention=True, offload="cpu", gpu_mib=80 << 10,
                                host_mib=100 << 10)
    params = sum(p.numel() for p in model.parameters())
    terms = {t.name: t.nbytes for t in plan.peak.terms}
    assert terms["weights"] == 2 * params
    assert terms["gradients"] == 2 * (params - model.get_input_embeddings().weight.numel())
    assert plan.placement == (HOST,) * 4 and plan.fits and plan.peak.moment == "in layer 0's backward"
    assert "memory plan: 131,072 tokens" in str(plan) and "layer inputs on the host (pinned)" in str(plan)


def test_auto_keeps_what_fits_then_the_host_then_recomputes():
    model = meta_model("8b", 8)
    kept = 131072 * 4096 * 2
    roomy = tiledmlp.plan_memory(model, 131072, norms=True, attention=True, offload="auto", gpu_mib=200 << 10,
                                 host_mib=0)
    assert roomy.placement == (GPU,) * 8 and roomy.fits
    tight = tiledmlp.plan_memory(model, 131072, norms=True, attention=True, offload="auto",
                                 gpu_mib=(roomy.gpu_peak_bytes - 3 * kept) / 2**20, host_mib=(2 * kept) / 2**20)
    assert tight.fits and tight.placement.count(GPU) == 5 and tight.placement.count(HOST) <= 2
    assert tight.placement[0] != RECOMPUTE and tight.placement[-5:] == (GPU,) * 5
    assert tight.gpu_peak_bytes <= tight.gpu_budget_bytes and tight.host_peak_bytes <= tight.host_budget_bytes
    none = tiledmlp.plan_memory(model, 131072, norms=True, attention=True, offload="auto", gpu_mib=1024, host_mib=0)
    assert not none.fits and none.longest_seq_len < 131072
    longest = tiledmlp.plan_memory(model, tight.longest_seq_len, norms=True, attention=True, offload="auto",
                                   gpu_mib=tight.gpu_budget_bytes / 2**20, host_mib=tight.host_budget_bytes / 2**20)
    assert longest.fits and tight.longest_seq_len >= 131072


def test_arrange_spreads_the_recomputed_layers():
    assert arrange(6, 2, 2) == (HOST, RECOMPUTE, HOST, RECOMPUTE, GPU, GPU)
    assert arrange(6, 0, 4) == (HOST, RECOMPUTE, RECOMPUTE, RECOMPUTE, HOST, RECOMPUTE)
    assert arrange(4, 0, 4) is None and arrange(4, 4, 0) == (GPU,) * 4


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="gradient_checkpointing_enable"):
        tiledmlp.plan_memory(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)), 128)
    with pytest.raises(ValueError, match="Hugging Face config"):
        tiledmlp.plan_memory(torch.nn.Linear(2, 2), 128)
    with pytest.raises(ValueError, match="seq_len"):
        tiledmlp.plan_memory(meta_model("1b", 1), 0)
    with pytest.raises(TypeError, match="options that change its terms"):
        tiledmlp.plan_memory(meta_model("1b", 1), 1024, tile_tokens=512)


def test_default_host_budget_counts_the_buffers_already_pinned(monkeypatch):
    """After a step, the offloader's pool is host memory the next steps reuse: not taken from their budget."""
    from tiledmlp.offload import checkpointing
    from tiledmlp.plan import plans

    monkeypatch.setattr(plans, "available_host_bytes", lambda: 10 << 30)
    monkeypatch.setattr(checkpointing, "_OFFLOADERS", {})
    model = meta_model("1b", 1)
    assert plans.budgets(model)[1] == (10 << 30) - plans.HOST_MARGIN
    checkpointing.offloader_for(torch.device("meta")).stats["host_bytes"] = 3 << 30
    assert plans.budgets(model)[1] == (13 << 30) - plans.HOST_MARGIN

"""The benchmark scripts run end to end on a CPU (``--smoke``: tiny sizes, float32), write their CSV and
plot, and what they measure agrees across providers — so a GPU session never finds a broken script."""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_compile  # noqa: E402
import bench_ddp  # noqa: E402
import bench_decode  # noqa: E402
import bench_first_step  # noqa: E402
import bench_loss  # noqa: E402
import bench_longctx  # noqa: E402
import bench_qlora  # noqa: E402
import profile_layer_memory  # noqa: E402
import bench_sp  # noqa: E402
import bench_mlp  # noqa: E402
import mlp_providers  # noqa: E402
import bench_moe  # noqa: E402


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_bench_loss_smoke(tmp_path):
    bench_loss.main(["--smoke", "--out", str(tmp_path)])
    rows = _csv(tmp_path / "bench_loss_cpu_smoke.csv")
    assert (tmp_path / "bench_loss_cpu_smoke.png").stat().st_size > 0
    providers = {r["provider"] for r in rows}
    assert {"hf", "tiledmlp", "tiledmlp_fused", "tiledmlp_recompute", "gemms"} <= providers
    assert {(r["V"], r["T"]) for r in rows} == {(v, t) for v in ("500", "1000") for t in ("256", "1024")}
    for row in rows:
        assert row["gpu_name"] == "cpu" and row["torch"] and row["date"]
        assert float(row["time_ms"]) > 0
        if row["provider"] != "gemms":  # float32 on the CPU: every provider near the float64 reference
            assert max(float(row[k]) for k in ("err_loss", "err_dx", "err_dw")) < 1e-5, row
    assert {r["mode"].split(":")[0] for r in rows if r["provider"] == "tiledmlp_recompute"} == {"recompute"}


def test_bench_longctx_smoke(tmp_path):
    bench_longctx.main(["--smoke", "--out", str(tmp_path)])
    rows = _csv(tmp_path / "bench_longctx_cpu_smoke.csv")
    assert (tmp_path / "bench_longctx_cpu_smoke.png").stat().st_size > 0
    assert {r["variant"] for r in rows} == {"untiled", "mlp", "loss", "loss+offload", "loss+norms",
                                             "loss+norms+offload", "loss+norms+offload+attn", "loss+norms+auto",
                                             "loss+norms+auto+attn", "seq_len"}
    # what enable_tiling(seq_len=T) chose, and why, beside the variants it chose among
    assert all(re.match(rf"seq_len={r['T']}: offload='auto', .*norms=(True|False), attention=(True|False) \(the ",
                        r["chosen"]) and "configuration" in r["chosen"] for r in rows if r["variant"] == "seq_len")
    assert all(float(r["host_rss_gib"]) > 0 for r in rows)
    for tokens in {r["T"] for r in rows}:
        losses = [float(r["loss"]) for r in rows if r["T"] == tokens]
        assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), losses  # same model, same loss
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    # the plan beside each tiled variant; the smoke model's layer inputs are too small to offload, as the plan knows
    assert all(float(r["predicted_gib"]) > 0 for r in rows if r["variant"] != "untiled")
    assert all(float(r["host_gib"]) == 0 for r in rows)
    assert all(float(r["predicted_host_gib"]) == 0 for r in rows if r["variant"] != "untiled")


def test_bench_first_step_smoke(tmp_path):
    """Each variant in a fresh process: the first step and the later ones timed, their losses alike."""
    rows = bench_first_step.main(["--smoke", "--out", str(tmp_path), "--variants", "untiled,loss+norms+offload"])
    assert [r["variant"] for r in _csv(tmp_path / "bench_first_step_cpu_smoke.csv")] == ["untiled", "loss+norms+offload"]
    for row in rows:
        assert row["first_s"] > 0 and row["steady_s"] > 0 and row["enable_s"] >= 0 and row["compiles"] == 0, row
        assert row["overhead_s"] == row["first_s"] - row["steady_s"]


def test_bench_longctx_packed_smoke(tmp_path):
    """``--packed``: documents of mixed lengths in one row, ``position_ids`` restarting per document and each
    document's first label ignored, as TRL's padding-free collator builds them; tiled == untiled on them."""
    batch = bench_longctx.batch_of(1000, 4096, True, torch.device("cpu"))
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    lengths = [b - a for a, b in zip(starts, starts[1:] + [4096])]
    assert len(lengths) > 2 and len(set(lengths)) > 1 and sum(lengths) == 4096  # mixed lengths, filling the row
    assert all(torch.equal(batch["position_ids"][0, a:a + n], torch.arange(n)) for a, n in zip(starts, lengths))
    assert (batch["labels"] == -100).sum() == len(starts)
    assert torch.equal(batch["labels"][0, starts], torch.full((len(starts),), -100))
    rows = bench_longctx.main(["--smoke", "--packed", "--variants", "untiled,loss+norms+offload+attn",
                               "--out", str(tmp_path)])
    assert all(int(r["documents"]) > 2 for r in rows)
    for tokens in {r["T"] for r in rows}:
        losses = [float(r["loss"]) for r in rows if r["T"] == tokens]
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0]), losses


def test_bench_longctx_model_shapes():
    """``--model 8b`` is the Llama-3.1-8B shape (untied head), ``1b`` the Llama-3.2-1B one (tied)."""
    assert bench_longctx.MODELS["8b"] == dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8,
                                              vocab=128256, tied=False)
    assert bench_longctx.parse_args(["--model", "8b"]).model == "8b"


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast"])
def test_bench_qlora_smoke(tmp_path, autocast):
    """4-bit MLP (alone and checkpointed) and model, untiled and tiled: the tiled ones in the GLU form with their
    4-bit weights (and the loss and norms for the model); the same loss either way (within bf16's error under
    autocast, the Trainer's bf16=True)."""
    rows = bench_qlora.main(["--smoke", "--out", str(tmp_path)] + (["--autocast"] if autocast else []))
    assert (tmp_path / "bench_qlora_cpu_smoke.csv").stat().st_size > 0
    by = {(r["kind"], r["variant"]): r for r in rows}
    assert set(by) == {(k, v) for k in ("mlp", "mlp+ckpt") for v in ("untiled", "tiled")} | {
        ("step", v) for v in ("untiled", "tiled", "tiled+proj")}
    assert by["mlp", "tiled"]["forms"] == "glu" and by["step", "tiled"]["forms"] == "glu+loss+norm"
    assert by["step", "tiled+proj"]["forms"] == "glu+loss+norm+proj"
    assert by["mlp", "untiled"]["forms"] == "" and all(r["time_s"] > 0 and r["autocast"] is autocast for r in rows)
    for variant in ("untiled", "tiled", "tiled+proj"):  # a training step: the second step's loss after AdamW's first
        row = by["step", variant]
        first, second = map(float, row["losses"].split(";"))
        assert row["optimizer"] == "adamw" and first != second and row["optimizer_s"] > 0
    tol = 2e-2 if autocast else 1e-5
    for variant in ("tiled", "tiled+proj"):
        assert abs(by["step", variant]["loss"] - by["step", "untiled"]["loss"]) <= tol * abs(by["step", "untiled"]["loss"])


def test_profile_layer_memory_smoke(tmp_path):
    """The replay finds the peak (not the end, not before a free) and groups its live blocks by their author: a
    backward node by its name, a forward by its line outside torch; a free of a block from before is ignored."""
    rows = profile_layer_memory.main(["--smoke", "--out", str(tmp_path)])
    assert [(r["origin"], r["bytes"], r["count"]) for r in rows] == [("modeling_llama.py:forward:1", 300, 1),
                                                                     ("MmBackward0", 200, 1)]
    assert (tmp_path / "profile_layer_memory_smoke.md").read_text().count("|") > 6


def test_bench_decode_smoke(tmp_path):
    bench_decode.main(["--smoke", "--out", str(tmp_path)])
    rows = _csv(tmp_path / "bench_decode_cpu_smoke.csv")
    assert [r["variant"] for r in rows] == ["untiled", "tiled"]
    assert all(r["same_tokens"] == "True" and float(r["ms_per_token"]) > 0 for r in rows)


def test_bench_compile_smoke(tmp_path):
    """Both blocks, every variant; the compiled tiled blocks compile into one graph holding the tiled operator."""
    bench_compile.main(["--smoke", "--out", str(tmp_path)])
    rows = _csv(tmp_path / "bench_compile_cpu_smoke.csv")
    assert (tmp_path / "bench_compile_cpu_smoke.png").stat().st_size > 0
    assert {(r["block"], r["variant"]) for r in rows} == {(b, v) for b in bench_compile.SIZES for v in bench_compile.VARIANTS}
    assert all(float(r["time_ms"]) > 0 for r in rows)
    for r in rows:
        if r["variant"].endswith("compiled"):
            assert r["graphs"] == "1", r
            assert r["tiled_ops"] == ("1" if r["variant"] == "tiled_compiled" else "0"), r


def test_bench_mlp_styles_smoke(tmp_path):
    """Every MLP style in one run, each against its own eager block; tiledmlp's rows near float64."""
    styles = ",".join(mlp_providers.STYLES)
    bench_mlp.main(["--smoke", "--style", styles, "--out", str(tmp_path)])
    stem = f"bench_mlp_cpu_silu_{styles.replace(',', '-')}_quick"
    rows = _csv(tmp_path / f"{stem}.csv")
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
    assert {r["style"] for r in rows} == set(mlp_providers.STYLES)
    for style in mlp_providers.STYLES:
        mine = [r for r in rows if r["style"] == style]
        assert {r["provider"] for r in mine} >= {"eager", "tiledmlp", "tiledmlp_fp32acc"}
        for row in mine:
            assert float(row["time_ms"]) > 0 and float(row["time_ratio_vs_eager"]) > 0
            assert max(float(row[k]) for k in ("err_out", "err_dx", "err_w_max")) < 1e-5, row


def test_bench_mlp_lora_smoke(tmp_path):
    """``--lora``: peft adapters on every projection, frozen base; the fast forms with the adapters and the
    generic form both near float64, each against the untiled peft module."""
    bench_mlp.main(["--smoke", "--lora", "4", "--style", "act_fn,plain,conv1d", "--out", str(tmp_path)])
    rows = _csv(tmp_path / "bench_mlp_cpu_silu_act_fn-plain-conv1d_lora4_quick.csv")
    assert {(r["style"], r["provider"], r.get("form", "")) for r in rows if r["T"] == "64"} == {
        (style, provider, form) for style, fast in (("act_fn", "glu"), ("plain", "mlp"), ("conv1d", "mlp"))
        for provider, form in (("eager", "n/a"), ("tiledmlp", fast), ("tiledmlp_generic", "generic"))}
    for row in rows:
        assert [k for k in row if k.startswith("err_w:")] and all("lora_" in k for k in row if k.startswith("err_w:"))
        assert max(float(row[k]) for k in ("err_out", "err_dx", "err_w_max")) < 1e-5, row


def test_bench_mlp_compiled_providers_smoke(tmp_path):
    """The compile comparison (issue 16's bench): compiled eager and compiled tiled blocks run and agree."""
    bench_mlp.main(["--smoke", "--providers", "eager,eager_compiled,tiledmlp,tiledmlp_compiled", "--out",
                    str(tmp_path)])
    (path,) = tmp_path.glob("bench_mlp_cpu_*.csv")
    rows = _csv(path)
    assert {r["provider"] for r in rows} == {"eager", "eager_compiled", "tiledmlp", "tiledmlp_compiled"}
    for row in rows:
        assert float(row["time_ms"]) > 0 and max(float(row[k]) for k in ("err_out", "err_dx", "err_w_max")) < 1e-5, row


def test_bench_moe_smoke(tmp_path):
    """Both MoE blocks with the untiled eager and grouped_mm experts and the MoE form (DeepSpeed when
    installed), and the end-to-end rows: all agree with float64, ratios against grouped_mm filled in."""
    written = bench_moe.main(["--smoke", "--e2e", "--out", str(tmp_path)])
    for block in bench_moe.BLOCKS:
        rows = _csv(tmp_path / f"bench_moe_cpu_{block}_smoke.csv")
        assert (tmp_path / f"bench_moe_cpu_{block}_smoke.png").stat().st_size > 0
        assert {"eager", "grouped_mm", "tiledmlp"} <= {r["provider"] for r in rows}
        for row in rows:
            assert float(row["time_ratio_vs_grouped_mm"]) > 0, row
            assert max(float(row[k]) for k in ("err_out", "err_dx", "err_w_max")) < 1e-5, row
            if row["provider"] == "tiledmlp":
                assert row["form"] == "moe", row
    e2e = _csv(tmp_path / "bench_moe_e2e_cpu_smoke.csv")
    assert {(r["variant"], r["status"]) for r in e2e} == {("untiled", "ok"), ("tiledmlp", "ok")}
    assert len(written) == len(bench_moe.BLOCKS) + 1


def test_unknown_names_are_refused():
    with pytest.raises(SystemExit, match="unknown provider"):
        bench_loss.available(["hf", "magic"], bench_loss.torch.device("cpu"))
    for script in (bench_longctx, bench_first_step, bench_qlora, bench_sp):
        with pytest.raises(SystemExit, match=r"unknown variants \['magic'\]; known: untiled, "):
            script.parse_args(["--variants", "untiled,magic"])
    with pytest.raises(SystemExit, match="--style"):
        bench_mlp.parse_args(["--quick", "--style", "act_fn,magic"])
    with pytest.raises(SystemExit, match="--blocks"):
        bench_moe.parse_args(["--smoke", "--blocks", "magic"])


def test_bench_sp_ring_variants_need_gpus(capsys):
    """torch's ring attention has no CPU kernels: on CPUs the default leaves the ring variants out, and asking for
    one exits naming it."""
    assert not set(bench_sp.parse_args(["--smoke"]).variants) & set(bench_sp.RING)
    with pytest.raises(SystemExit):
        bench_sp.parse_args(["--smoke", "--variants", "untiled,ring"])
    assert "ring: torch's ring attention has no CPU kernels" in capsys.readouterr().err


def test_bench_sp_alst_is_not_run_under_fsdp2(capsys):
    """The ALST stack's loss calls the model's parts past FSDP2's root unit: --shard fsdp2 refuses it, naming why."""
    with pytest.raises(SystemExit):
        bench_sp.parse_args(["--smoke", "--shard", "fsdp2", "--variants", "untiled,alst"])
    assert "alst: its loss calls the model's parts directly" in capsys.readouterr().err
    assert bench_sp.parse_args(["--smoke", "--shard", "fsdp2", "--variants", "untiled,tiled"]).shard == "fsdp2"


def test_bench_ddp_measures_one_zero3_engine_per_process_on_gpus():
    """A DeepSpeed engine's memory outlives destroy(): a second ZeRO-3 variant in the process would count it."""
    several = bench_ddp.parse_args(["--wrap", "zero3", "--variants", "untiled,tiled"])
    with pytest.raises(SystemExit, match="one variant per process"):
        bench_ddp.check_one_variant_per_engine(several, torch.device("cuda", 0))
    bench_ddp.check_one_variant_per_engine(several, torch.device("cpu"))  # no peaks measured on a CPU
    one = bench_ddp.parse_args(["--wrap", "zero3", "--variants", "tiled"])
    bench_ddp.check_one_variant_per_engine(one, torch.device("cuda", 0))
    ddp = bench_ddp.parse_args(["--wrap", "ddp", "--variants", "untiled,tiled"])
    bench_ddp.check_one_variant_per_engine(ddp, torch.device("cuda", 0))


def test_walk_one_call_follows_a_tiled_call_through_the_packages():
    """benchmarks/walk_one_call.py: where one tiled MLP call goes, by package (a call after the first recognizes
    nothing; that it reads no wrapping either is tests/unit/distributed/test_selection.py's)."""
    import walk_one_call

    result = walk_one_call.main()
    assert {"patching", "core", "forms"} <= set(result["entered"]) and result["moves"] > 0
    assert "recognize" not in result["entered"]
    # folded: the form's two shards are one loop, walked twice
    assert "(forms > kernels > forms > core) x2" in result["folded"]["walk"]
    assert result["folded"]["moves"] < result["moves"]


def test_states_first_makes_the_states_and_moves_no_weight():
    """``--states-first`` (``optimizer_step.make_states``): the measured steps hold AdamW's states as a later step
    does, and no weight moved making them; an optimizer whose zero-gradient step would move weights is refused."""
    from optimizer_step import make_states

    model = torch.nn.Linear(8, 4)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    make_states(optimizer)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(set(optimizer.state[p]) >= {"exp_avg", "exp_avg_sq"} and p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="weight decay"):
        make_states(torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01))

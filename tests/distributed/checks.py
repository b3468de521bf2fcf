"""What the matrix asserts of a case's per-rank metrics (``matrix.py`` lists each case's checks; ``test_matrix.py`` runs
each as a test of its own). A :class:`Check` is given every rank's metrics, the case, and the launch's world size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import transformers
from packaging.version import Version

from .common import device_type
from .harness import (assert_compiled_like_untiled, assert_matches_untiled, assert_syncs_only_on_last_micro_batch,
                      assert_tiled_like_untiled, assert_within_bf16_noise)

if TYPE_CHECKING:
    from .matrix import Case

Metrics = list[dict[str, Any]]


@dataclass(frozen=True)
class Check:
    """One assertion on a case's metrics, named in its test id."""

    name: str
    check: Callable[[Metrics, "Case", int], None]

    def __call__(self, metrics: Metrics, case: Case, world: int) -> None:
        self.check(metrics, case, world)


# ----------------------------------------------------------------------------------------------
# Every wrapper

#: the same training (fp32 tolerances) and the same execution shape as untiled: the strategy, the shards, no module
#: call in backward, the same collectives micro-batch by micro-batch
MATCHES_UNTILED = Check("matches_untiled", lambda m, case, _: assert_matches_untiled(m, case.expected_strategy))
#: the same, but for the collectives: where the untiled reference runs under other options (or counts none)
TRAINS_LIKE_UNTILED = Check("trains_like_untiled",
                            lambda m, case, _: assert_matches_untiled(m, case.expected_strategy, collectives=False))
#: bf16: the tiled run no further (x1.5) from an untiled float32 run than the untiled bf16 run, and like untiled
WITHIN_BF16_NOISE = Check("within_bf16_noise", lambda m, case, _: assert_within_bf16_noise(m, case.expected_strategy))
#: compiled per block: as many graphs as untiled (no graph break), the tiled operator in them
COMPILED_LIKE_UNTILED = Check("compiled_like_untiled", lambda m, case, _: assert_compiled_like_untiled(m))


def syncs_on_last_micro_batch(collective: str) -> Check:
    """Gradient accumulation: ``collective`` (the one that reduces gradients) on the last micro-batch of each step
    only, and the local gradients of the others as untiled's where the wrapper keeps them in ``.grad``."""
    return Check("syncs_on_last_micro_batch",
                 lambda m, case, _: assert_syncs_only_on_last_micro_batch(m, collective))


def _local_gradients_compared(metrics: Metrics, case: Case, world: int) -> None:
    for rank, m in enumerate(metrics):
        assert "accumulated_grad_rel" in m, f"rank {rank}: the wrapper's local gradients were not compared"


#: DDP and FSDP1 keep the accumulated gradients in ``.grad``: they were compared with untiled's
LOCAL_GRADIENTS_COMPARED = Check("local_gradients_compared", _local_gradients_compared)


def _silent_inside_no_sync(metrics: Metrics, case: Case, world: int) -> None:
    for rank, m in enumerate(metrics):
        micro = len(m["collectives_tiled"]) // len(m["shards_per_step"])
        idle = [c for i, c in enumerate(m["collectives_tiled"]) if i % micro != micro - 1]
        assert not any(idle), f"rank {rank}: collectives inside no_sync(): {idle}"


#: DDP's accumulation micro-batches issue no collective at all
SILENT_INSIDE_NO_SYNC = Check("silent_inside_no_sync", _silent_inside_no_sync)


def _shard_count_changes(metrics: Metrics, case: Case, world: int) -> None:
    for m in metrics:
        assert len(set(m["shards_per_step"])) > 1, f"the shard count never changed: {m['shards_per_step']}"
    assert len({tuple(m["shards_per_step"]) for m in metrics}) == len(metrics), "ranks should cut differently"


#: ``static_graph=True`` while the shard count changes from step to step and rank to rank
SHARD_COUNT_CHANGES = Check("shard_count_changes", _shard_count_changes)


def _anchor_caught(metrics: Metrics, case: Case, world: int) -> None:
    for m in metrics:
        assert m["anchor_error"] is not None or m["update_rel"] > 0.1, m


#: the anchors' per-shard backward trains differently (or fails): the comparison detects what tiledmlp avoids
ANCHOR_CAUGHT = Check("anchor_caught", _anchor_caught)


def _plain_refused(metrics: Metrics, case: Case, world: int) -> None:
    for rank, m in enumerate(metrics):
        assert "strategy='plain' does not match how" in m["refused"] and "(ddp)" in m["refused"], (rank, m)


PLAIN_REFUSED_UNDER_DDP = Check("plain_refused_under_ddp", _plain_refused)


def _head_tiled(metrics: Metrics, case: Case, world: int) -> None:
    for rank, m in enumerate(metrics):
        assert any(name.endswith("lm_head") for name in m["strategies"]), (
            f"rank {rank}: the head is not tiled: {m['strategies']}")


#: the tiled loss: the LM head is one of the tiled modules
HEAD_TILED = Check("head_tiled", _head_tiled)


# ----------------------------------------------------------------------------------------------
# A checkpointed Llama's layer inputs


def offloaded(per_layer: int) -> Check:
    """``offload="cpu"``, 3 steps x 2 checkpointed layers: the same training and collectives as the untiled
    checkpointed model, and every layer input went to the host and came back. Backward recomputes each layer, so
    each of its ``per_layer`` tiled modules (the MLP; with norms=True its two RMSNorms) is called once per step in
    backward (by the checkpoint, as untiled — never per shard); and the layer's FSDP2 unit as often as untiled
    (transformers before 5.24 checkpoints the layer's ``__call__``, its FSDP2 hooks included)."""
    def check(metrics: Metrics, case: Case, world: int) -> None:
        for m in metrics:
            m["calls_in_backward"] -= 3 * 2 * per_layer  # the checkpoint's recompute of each layer, once per step
        assert_matches_untiled(metrics, case.expected_strategy)
        for rank, m in enumerate(metrics):
            assert m["offload_regions"] == m["offload_restored"] == 3 * 2, (rank, m)
    return Check("offloads_every_layer_input", check)


def chained(per_layer: int) -> Check:
    """``offload="auto"`` with layer 1's input recomputed from layer 0's in backward, 3 steps: the same training as the
    untiled checkpointed model. In backward each step recomputes both layers (the checkpoint) and runs layer 0's
    forward once more (to rebuild layer 1's freed input): its ``per_layer`` tiled modules are called once more than
    untiled; under FSDP2 layer 0's unit gathers its parameters once more (its collectives differ), and transformers
    before 5.24, which checkpoints the layer's ``__call__``, calls the unit once more too. FSDP2's case keeps both
    layers' attention outputs for their recompute (float32: computed on a CPU only)."""
    def check(metrics: Metrics, case: Case, world: int) -> None:
        fsdp2 = case.expected_strategy == "fsdp2"
        unit_calls = 3 if fsdp2 and Version(transformers.__version__) < Version("5.24") else 0
        for m in metrics:
            m["calls_in_backward"] -= 3 * (2 + 1) * per_layer + unit_calls
        assert_matches_untiled(metrics, case.expected_strategy, collectives=not fsdp2)
        kept = 3 * 2 if fsdp2 and device_type() == "cpu" else 0
        for rank, m in enumerate(metrics):
            assert m["freed"] == m["rebuilt"] == 3, (rank, m)
            assert m["kept"] == m["reused"] == kept, (rank, m)
    return Check("rebuilds_by_a_recompute_chain", check)


# ----------------------------------------------------------------------------------------------
# Tensor parallelism

N_LAYERS = 2  # titan.N_LAYERS: tiled MLP calls per micro-batch


def _reduces_gate_and_up_once(metrics: Metrics, case: Case, world: int) -> None:
    for rank, m in enumerate(metrics):
        for i, (tiled, untiled) in enumerate(zip(m["collectives_tiled"], m["collectives_untiled"])):
            expected = dict(untiled, dtensor_all_reduce=untiled["dtensor_all_reduce"] - N_LAYERS)
            assert tiled == expected, f"rank {rank}, micro-batch {i}: tiled {tiled}, untiled {untiled}"


#: without sequence parallelism untiled all-reduces the gate's and the up projection's input gradients apart, tiled
#: sums them first: one all-reduce fewer per MLP call, every other collective the same
REDUCES_GATE_AND_UP_ONCE = Check("reduces_gate_and_up_once", _reduces_gate_and_up_once)


def _collectives_per_call(metrics: Metrics, case: Case, world: int) -> None:
    want = {"replicated": ({"all_reduce": 1}, {"all_reduce": 1}),
            "sequence_parallel": ({"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1},) * 2}
    for rank, m in enumerate(metrics):
        for layout, (forward, backward) in want.items():
            got, ref = m[layout]["tiled"], m[layout]["untiled"]
            where = f"rank {rank}, {layout}"
            assert got["shards"] >= 3, f"{where}: {got['shards']} shards, the count is vacuous"
            assert got["forward"] == ref["forward"] == forward, f"{where}: forward {got['forward']} vs {ref['forward']}"
            assert got["backward"] == backward, f"{where}: backward {got['backward']}, want {backward}"
            assert all(got["backward"][k] <= ref["backward"].get(k, 0) for k in got["backward"]), where
            assert m[layout]["out_rel"] <= 1e-6 and m[layout]["dx_rel"] <= 1e-6, f"{where}: {m[layout]}"


#: one MLP call: forward issues exactly the untiled call's collectives, backward the same with sequence parallelism
#: and one all-reduce instead of two without; never one per shard; the same numbers
COLLECTIVES_PER_CALL = Check("collectives_per_call", _collectives_per_call)


def _describes_the_local_slice(metrics: Metrics, case: Case, world: int) -> None:
    for rank, m in enumerate(metrics):
        for key in ("described_replicated", "described_sequence_parallel"):
            ((form, strategy, computes, scratch, bare_scratch),) = m[key]
            assert (form, strategy) == ("glu", "tp") and computes == "w2(silu(w1(x)) * w3(x))", (rank, m[key])
            assert scratch * world == bare_scratch, f"rank {rank}: scratch {scratch} vs bare {bare_scratch}"


#: enabled after parallelize_module, the probe identifies torchtitan's FeedForward from gathered weights, and
#: describe() sizes the scratch of the rank's slice of the intermediate dimension
DESCRIBES_THE_LOCAL_SLICE = Check("describes_the_local_slice", _describes_the_local_slice)


def bad_plan(plan: str, *words: str) -> Check:
    """The bad plan ``plan`` refused with a ValueError containing ``words`` (what is wrong, and the fix), the model
    untouched."""
    def check(metrics: Metrics, case: Case, world: int) -> None:
        for rank, m in enumerate(metrics):
            result = m[plan]
            assert result["message"] is not None, f"rank {rank}: {plan} was accepted"
            missing = [w for w in words if w not in result["message"]]
            assert not missing, f"rank {rank}: {plan} message lacks {missing}: {result['message']}"
            assert result["untouched"], f"rank {rank}: {plan} changed the model before refusing"
    return Check(f"refuses_{plan}", check)


# ----------------------------------------------------------------------------------------------
# DeepSpeed


def gathers(at_most_once_in_backward: bool = False, probed_first: bool = False) -> Check:
    """Per micro-batch, each parameter is all-gathered as often as untiled: in forward exactly (``probed_first``:
    an MLP's once more in the first forward, for the probe that plans it again); in backward exactly, or
    (``at_most_once_in_backward``: recomputing a module whose input needs no gradient reads frozen weights that the
    untiled backward, which kept the activations, does not gather again) once where the untiled backward did not."""
    def check(metrics: Metrics, case: Case, world: int) -> None:
        for rank, m in enumerate(metrics):
            untiled, tiled = m["gathers_untiled"], m["gathers_tiled"]
            assert len(untiled) == len(tiled) > 0, f"rank {rank}: {len(untiled)} vs {len(tiled)} micro-batches counted"
            for i, (u, t) in enumerate(zip(untiled, tiled)):
                for name in sorted(set(u) | set(t)):
                    got, want = t.get(name, 0), u.get(name, 0)
                    ok = (got == want or (at_most_once_in_backward and name.startswith("backward:") and got == 1)
                          or (probed_first and i == 0 and name.startswith("forward:") and ".mlp." in name
                              and got == want + 1))
                    assert ok, f"rank {rank}, micro-batch {i}: {name} gathered {got} times, untiled {want}"
    return Check("gathers_as_untiled", check)


def _gathers_counted(metrics: Metrics, case: Case, world: int) -> None:
    for m in metrics:
        first = m["gathers_untiled"][0]
        assert first.get("forward:layers.0.mlp.gate_proj.weight") == 1, first
        assert first.get("backward:layers.0.mlp.gate_proj.weight") == 1, first


#: the gather counter sees ZeRO-3's gathers (else the gather comparisons would be vacuous)
GATHERS_COUNTED = Check("gathers_counted", _gathers_counted)


def _engine_bf16(metrics: Metrics, case: Case, world: int) -> None:
    assert_tiled_like_untiled(metrics, case.expected_strategy, collectives=False)
    for rank, m in enumerate(metrics):
        assert m["bf16_noise"] > 0, f"rank {rank}: bf16 run identical to fp32: bf16 is not on"
        assert m["tiled_error"] <= 1.05 * m["bf16_noise"], (
            f"rank {rank}: tiled bf16 is {m['tiled_error']:.3g} from fp32, untiled bf16 {m['bf16_noise']:.3g}")


#: a bf16 engine: the tiled run no further (x1.05) from the untiled float32 run than the untiled bf16 run
ENGINE_WITHIN_BF16_NOISE = Check("within_bf16_noise", _engine_bf16)


def _prefetch_trace_kept(metrics: Metrics, case: Case, world: int) -> None:
    for rank, m in enumerate(metrics):
        assert len(set(m["seq_lens"])) > 2, m["seq_lens"]
        assert m["invalidations"]["tiled"] == m["invalidations"]["untiled"] == [0] * len(m["seq_lens"]), (
            f"rank {rank}: ZeRO-3 trace invalidations per step {m['invalidations']}")


PREFETCH_TRACE_KEPT = Check("prefetch_trace_never_invalidated", _prefetch_trace_kept)


def _enabled_after_steps(metrics: Metrics, case: Case, world: int) -> None:
    for rank, m in enumerate(metrics):
        assert m["param_rel"] <= 1e-5, f"rank {rank}: parameters differ by {m['param_rel']:.3g}"
        assert (m["invalidations_untiled"], m["invalidations_tiled"]) == (0, 1), m


#: enabling on a trained engine drops the trace ZeRO-3 recorded untiled once (the counter's control), and training
#: continues exactly
ENABLED_AFTER_STEPS = Check("trains_on_exactly", _enabled_after_steps)


def _engine_refusals(metrics: Metrics, case: Case, world: int) -> None:
    for m in metrics:
        assert "use strategy='plain'" in m["errors"]["deepspeed_on_plain"]
        assert "use strategy='deepspeed'" in m["errors"]["ddp_on_zero3"]
        assert m["untouched"], "a refused enable_tiling patched modules"
        assert set(m["forced"].values()) == {"deepspeed"} and len(m["forced"]) == 2


ENGINE_REFUSALS = Check("refuses_and_leaves_the_model", _engine_refusals)

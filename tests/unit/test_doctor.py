"""``tiledmlp-doctor`` (``tiledmlp.integrations.check``): the environment, what ``enable_tiling`` would do to a model
given by its config (a one-layer twin) with its memory plan, and the conflicts it finds in a model: DeepSpeed's
``TiledMLP`` patched into an MLP's forward, as DeepSpeed's ALST tutorial (and Axolotl's ``tiled_mlp``) do."""

from __future__ import annotations

import types

import pytest
import torch

from tiledmlp.integrations import check

transformers = pytest.importorskip("transformers")


@pytest.fixture
def config_dir(tmp_path):
    transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2).save_pretrained(tmp_path)
    return tmp_path


def test_the_environment_names_versions_devices_and_host_memory():
    said = check.environment()
    assert f"torch {torch.__version__}" in said and "tiledmlp 0." in said and "host memory this process may take" in said
    assert ("cuda:0" in said) == torch.cuda.is_available()


def test_a_config_says_what_enable_tiling_would_do_and_plans_a_length(config_dir, capsys):
    assert check.main(["--model", str(config_dir / "config.json"), "--seq-len", "65536",
                       "--options", '{"norms": true, "attention": true, "offload": "auto"}']) == 0
    said = capsys.readouterr().out
    assert ("LlamaForCausalLM, 4 layers; enable_tiling(model, norms=True, attention=True, offload='auto') would tile"
            in said)
    assert "model.layers.0.mlp" in said and "glu" in said and "loss tiled at lm_head" in said
    assert "memory plan: 65,536 tokens" in said and "norms=True, attention=True, offload='auto'" in said
    assert "conflict" not in said


def test_bad_arguments_name_the_fix(config_dir):
    for argv in (["--options", "[1]"], ["--options", "{nope"], ["--seq-len", "4096"]):
        with pytest.raises(SystemExit):
            check.main(argv)


@pytest.mark.parametrize("options, said", [
    ('{"norms": "x"}', "norms must be True or False, got str 'x'"),
    ('{"offload": "gpu"}', "offload='gpu': choose None"),
    ('{"nope": 1}', "enable_tiling got unknown options ['nope']"),
])
def test_an_option_refused_is_one_line_not_a_traceback(config_dir, options, said, capsys):
    """Before: the TypeError or ValueError of enable_tiling ended the command in a traceback."""
    with pytest.raises(SystemExit) as exited:
        check.main(["--model", str(config_dir), "--options", options])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith(f"tiledmlp-doctor: --options {options}: {said}"), err
    assert len(err.strip().splitlines()) == 1, err


def test_a_model_it_cannot_read_is_one_line_naming_a_local_config(monkeypatch, tmp_path, capsys):
    """A hub id offline (before: a 40-line OSError traceback), and a path that is not there."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    for model, said in (("some-org/some-model", "could not read the config of 'some-org/some-model': "),
                        (str(tmp_path / "missing" / "config.json"), "does not exist: pass a config.json")):
        with pytest.raises(SystemExit) as exited:
            check.main(["--model", model, "--seq-len", "4096"])
        err = capsys.readouterr().err
        assert exited.value.code == 1 and err.startswith("tiledmlp-doctor: ") and said in err, err
        assert len(err.strip().splitlines()) == 1 and "config.json" in err, err


def test_each_plan_printed_is_labelled(config_dir, capsys):
    """One plan, the whole model's, under a line saying so (before: the one-layer twin's plan and the model's, both
    unlabelled)."""
    assert check.main(["--model", str(config_dir), "--seq-len", "8192"]) == 0
    lines = capsys.readouterr().out.splitlines()
    plans = [i for i, line in enumerate(lines) if line.startswith("memory plan: 8,192 tokens")]
    assert len(plans) == 1 and lines[plans[0] - 1] == (
        "The whole model's memory plan on this machine (4 layers, bf16 weights and gradients, checkpointed layers, "
        "no optimizer states):"), "\n".join(lines)


def test_python_dash_m_tiledmlp_runs_the_doctor():
    """Before: ``python -m tiledmlp`` said there is no ``tiledmlp.__main__``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "tiledmlp", "--help"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(root)))
    assert proc.returncode == 0 and proc.stdout.startswith("usage: tiledmlp-doctor"), proc.stdout + proc.stderr


def test_deepspeed_s_tiled_mlp_patched_into_a_model_is_a_conflict():
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def tiled_mlp_forward(self, x):  # DeepSpeed's ALST tutorial: the MLP's forward through its TiledMLP
        def compute(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        return TiledMLP.apply(compute, self, x, 4, [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight])

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2))
    assert check.conflicts(model) == {}
    mlp = model.model.layers[1].mlp
    mlp.forward = types.MethodType(tiled_mlp_forward, mlp)
    found = check.conflicts(model)
    assert list(found) == ["model.layers.1.mlp"] and "DeepSpeed's TiledMLP" in found["model.layers.1.mlp"]

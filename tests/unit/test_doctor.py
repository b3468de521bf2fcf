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

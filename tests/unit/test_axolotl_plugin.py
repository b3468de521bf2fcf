"""tiledmlp's Axolotl plugin (``tiledmlp.integrations.axolotl``). Without Axolotl (CI's environment): the ``tiledmlp:``
section read into ``enable_tiling``'s options, which reach the model through the callback the plugin hands the
trainer; the refusals, each naming its fix. With Axolotl installed (``scripts/test_axolotl.sh`` runs this file in its
environment): the plugin loads through Axolotl's loader, its schema keeps the section through Axolotl's validation,
it refuses at registration, and its callback tiles. The training run itself, tiled == untiled through ``axolotl
train``, is ``scripts/test_axolotl.sh``'s."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import yaml

import tiledmlp
from tiledmlp.integrations import TilingCallback
from tiledmlp.integrations.axolotl_options import OPTIONS, check_config, tiling_options
from unit_helpers import checkpointed_llama

transformers = pytest.importorskip("transformers")

PLUGIN = "tiledmlp.integrations.axolotl.TiledMLPPlugin"
CHECKPOINTED = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}


def config(section: str = "", **keys) -> dict:
    """An Axolotl config as its YAML reads: the plugin, ``section`` (YAML text) as ``tiledmlp:``, and ``keys``."""
    cfg = {"plugins": [PLUGIN], "sequence_len": 256, "micro_batch_size": 2, **keys}
    if section:
        cfg["tiledmlp"] = yaml.safe_load(section)
    return cfg


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).train()


def test_the_section_takes_enable_tilings_keyword_arguments_one_for_one():
    fields = {f.name for f in dataclasses.fields(tiledmlp.TilingOptions) if f.init}
    named = set(inspect.signature(tiledmlp.enable_tiling).parameters) - {"model", "options", "kwargs"}
    assert set(OPTIONS) == fields and named <= fields


def test_the_section_reads_as_enable_tilings_options():
    cfg = config("""
        loss: false
        norms: true
        offload: null
        scratch_mib: 64
        grad_accum_dtype: float32
        loss_grad_accum_dtype: torch.bfloat16
        mlp_types: [torch.nn.Sequential]
        seq_len: auto
    """)
    assert tiling_options(cfg) == {"loss": False, "norms": True, "scratch_mib": 64, "grad_accum_dtype": torch.float32,
                                   "loss_grad_accum_dtype": torch.bfloat16, "mlp_types": (torch.nn.Sequential,),
                                   "seq_len": 512}  # sequence_len x micro_batch_size; a null is the key left out
    assert tiling_options(config("seq_len: 4096"))["seq_len"] == 4096
    assert tiling_options(config()) == tiling_options(config("{}")) == {}


@pytest.mark.parametrize("section, says", [
    ("{norm: true}", "norm: not an option of enable_tiling; the section takes strategy, num_shards, loss"),
    ("{grad_accum_dtype: fp32}", "grad_accum_dtype is one of float32, bfloat16, float16"),
    ("{seq_len: -1}", "seq_len is the tokens of one step"),
    ("{norms: 'yes'}", "norms is true or false"),
    ("{offload: gpu}", "offload is cpu, auto or null"),
    ("{mlp_types: [torch.nn.functional.silu]}", "torch.nn.functional.silu is not an nn.Module class"),
    ("{mlp_types: no_such_package.MLP}", "mlp_types: no_such_package.MLP does not import"),
    ("{loss_grad_accum_dtype: [float32]}", "loss_grad_accum_dtype is one of float32"),
    ("[norms]", "the tiledmlp: section of the Axolotl config is a mapping"),
])
def test_a_section_it_cannot_read_is_refused_naming_what_it_takes(section, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        check_config(config(section))


def test_seq_len_auto_needs_sequence_len():
    cfg = config("{seq_len: auto}")
    del cfg["sequence_len"]
    with pytest.raises(ValueError, match="set sequence_len, or give seq_len as a number of tokens"):
        tiling_options(cfg)


def test_the_options_reach_the_model_through_the_callback():
    """What the plugin hands Axolotl's trainer: a ``TilingCallback`` with the section's options, tiling the model when
    training begins (here: the norms, not the loss; and with ``seq_len``, the layer inputs placed by the plan)."""
    model = tiny_llama()
    TilingCallback(**tiling_options(config("{loss: false, norms: true}"))).on_train_begin(None, None, None, model)
    assert sorted({info.form for info in tiledmlp.describe(model).values()}) == ["glu", "norm"]
    model = checkpointed_llama(layers=2)
    options = tiling_options(config("{seq_len: auto, gpu_mib: 4096, host_mib: 4096}", **CHECKPOINTED))
    TilingCallback(**options).on_train_begin(None, None, None, model)
    assert sorted({info.form for info in tiledmlp.describe(model).values()}) == ["glu", "loss"]
    assert tiledmlp.offloaded_layers(model) == ["model.layers.0", "model.layers.1"]


def test_the_callbacks_model_trains_as_untiled():
    """Three SGD steps of the model the callback tiled from a section (loss, norms) against the untiled model:
    losses and parameters within 1e-5."""
    tiled, ref = tiny_llama(), tiny_llama()
    TilingCallback(**tiling_options(config("{norms: true, loss_scratch_mib: 0.01}"))).on_train_begin(
        None, None, None, tiled)
    assert sorted({info.form for info in tiledmlp.describe(tiled).values()}) == ["glu", "loss", "norm"]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (tiled, ref)]
    for step in range(3):
        ids = torch.randint(128, (2, 40), generator=torch.Generator().manual_seed(step))
        losses = [m(input_ids=ids, labels=ids).loss for m in (tiled, ref)]
        for loss, optimizer in zip(losses, optimizers):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    for (name, p), q in zip(tiled.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


def test_axolotls_tiled_mlp_is_refused():
    with pytest.raises(ValueError, match=r"both tile the MLP: set tiled_mlp: false"):
        check_config(config(tiled_mlp=True))
    check_config(config(tiled_mlp=False))


@pytest.mark.parametrize("key", ["liger_fused_linear_cross_entropy", "cut_cross_entropy"])
def test_a_fused_loss_is_refused_while_tiledmlp_tiles_the_loss(key):
    for section in ("", "{loss: true}", "{norms: true}"):  # the loss is tiled unless loss: false
        with pytest.raises(ValueError, match=rf"set {key}: false, or tiledmlp: {{loss: false}}"):
            check_config(config(section, **{key: True}))
    check_config(config("{loss: false}", **{key: True}))
    check_config(config(**{key: False}))


@pytest.mark.parametrize("keys, says", [
    ({}, "gradient_checkpointing is None; set gradient_checkpointing: true and gradient_checkpointing_kwargs: "
         "{use_reentrant: false}"),
    ({"gradient_checkpointing": True}, "Axolotl checkpoints reentrantly unless told otherwise"),
    ({"gradient_checkpointing": "offload", "gradient_checkpointing_kwargs": {"use_reentrant": False}},
     "gradient_checkpointing is 'offload'"),
    ({**CHECKPOINTED, "gradient_checkpointing_kwargs": {"use_reentrant": True}}, "set gradient_checkpointing_kwargs"),
    ({**CHECKPOINTED, "activation_offloading": True}, "activation_offloading: false, or leave out offload"),
])
def test_offload_without_non_reentrant_checkpointing_is_refused(keys, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace("{", r"\{")):
        check_config(config("{offload: cpu}", **keys))
    check_config(config("{norms: true}", **keys))  # only offload and seq_len need it


def test_seq_len_without_non_reentrant_checkpointing_is_refused():
    with pytest.raises(ValueError, match="seq_len: 512 needs the layers checkpointed"):
        check_config(config("{seq_len: auto}", gradient_checkpointing=True))
    check_config(config("{seq_len: auto, offload: cpu}", **CHECKPOINTED))


def test_the_plugin_module_says_it_needs_axolotl():
    try:
        import axolotl  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="tiledmlp's Axolotl plugin and needs Axolotl .*: install axolotl"):
            import tiledmlp.integrations.axolotl  # noqa: F401
    else:
        import tiledmlp.integrations.axolotl as plugin

        assert plugin.TiledMLPPlugin().get_input_args() == "tiledmlp.integrations.axolotl.TiledMLPArgs"


# With Axolotl installed (scripts/test_axolotl.sh)

def minimal_axolotl_config(tmp_path, **keys):
    from axolotl.utils.dict import DictDefault

    return DictDefault({"base_model": str(tmp_path), "datasets": [{"path": str(tmp_path / "d.jsonl"),
                                                                   "ds_type": "json", "type": "completion"}],
                        "sequence_len": 64, "micro_batch_size": 2, "gradient_accumulation_steps": 1,
                        "num_epochs": 1, "learning_rate": 1e-3, "output_dir": str(tmp_path / "out"),
                        "plugins": [PLUGIN], **keys})


def test_axolotl_loads_the_plugin_and_keeps_its_section(tmp_path):
    pytest.importorskip("axolotl")
    from axolotl.integrations.base import BasePlugin, PluginManager
    from axolotl.utils.config import prepare_plugins, validate_config

    cfg = minimal_axolotl_config(tmp_path, tiledmlp={"norms": True, "seq_len": "auto"}, **CHECKPOINTED)
    prepare_plugins(cfg)
    plugin = PluginManager.get_instance().plugins[PLUGIN]
    assert isinstance(plugin, BasePlugin)
    validated = validate_config(cfg)
    assert dict(validated["tiledmlp"]) == {"norms": True, "seq_len": "auto"}  # dropped if the schema lacked it
    plugin.pre_model_load(validated)
    callbacks = plugin.add_callbacks_pre_trainer(validated, None)
    assert len(callbacks) == 1 and isinstance(callbacks[0], TilingCallback)
    assert callbacks[0].options == {"norms": True, "seq_len": 128}
    model = checkpointed_llama(layers=2)
    callbacks[0].options.update(gpu_mib=4096, host_mib=4096)
    callbacks[0].on_train_begin(None, None, None, model=model)
    assert sorted({info.form for info in tiledmlp.describe(model).values()}) == ["glu", "loss", "norm"]
    assert tiledmlp.offloaded_layers(model) == ["model.layers.0", "model.layers.1"]


def test_axolotl_refuses_at_registration(tmp_path):
    pytest.importorskip("axolotl")
    from axolotl.utils.config import prepare_plugins

    with pytest.raises(ValueError, match="set tiled_mlp: false"):
        prepare_plugins(minimal_axolotl_config(tmp_path, tiled_mlp=True))
    with pytest.raises(ValueError, match="set liger_fused_linear_cross_entropy: false"):
        prepare_plugins(minimal_axolotl_config(tmp_path, liger_fused_linear_cross_entropy=True))

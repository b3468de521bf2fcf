"""Every Python block of ``docs/integrations.md`` runs as written (on a CPU, each in a fresh interpreter:
some start a process group; the DeepSpeed block needs the ``deepspeed`` test extra), and its Axolotl config is one the
plugin accepts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "integrations.md").read_text(), re.S)


def test_the_page_has_its_blocks():
    assert len(BLOCKS) == 9


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs(index, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", BLOCKS[index]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    expected = {0: "tiled 2 MLPs", 1: "{'0': 'plain'} {'module.0': 'ddp'}",
                2: "[('glu', 'deepspeed'), ('loss', 'deepspeed')]", 3: "['glu', 'loss']",
                4: "[('glu', True), ('loss', False)]", 5: "5 normalization layers", 6: "['glu', 'loss', 'proj']",
                7: "fsdp2+tp",
                8: "{'norms': True, 'attention': True, 'seq_len': 65536, 'loss_grad_accum_dtype': torch.float32}"}[index]
    assert expected in last, proc.stdout[-2000:]
    if index == 8:  # the Axolotl block prints the refusal it provokes, with its fix
        assert "set liger_fused_linear_cross_entropy: false, or tiledmlp: {loss: false}" in proc.stdout


def test_the_axolotl_config_is_one_the_plugin_accepts():
    """The YAML of the Axolotl section, read as the plugin reads it (``tiledmlp.integrations.axolotl_options``; the
    run through ``axolotl train`` is ``scripts/test_axolotl.sh``'s)."""
    import yaml

    from tiledmlp.integrations.axolotl_options import check_config, tiling_options

    section = (ROOT / "docs" / "integrations.md").read_text().split("\n## Axolotl\n", 1)[1]
    configs = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    assert len(configs) == 1
    assert configs[0]["plugins"] == ["tiledmlp.integrations.axolotl.TiledMLPPlugin"]
    check_config(configs[0])
    assert tiling_options(configs[0]) == {"norms": True, "attention": True, "seq_len": 65536}


def test_trainer_block_with_torch_compile(tmp_path):
    """The page says ``TrainingArguments(torch_compile=True)`` works too: the first block, compiled."""
    block = BLOCKS[0].replace("report_to=[], use_cpu=True)", "report_to=[], use_cpu=True, torch_compile=True, "
                                                              "torch_compile_backend='aot_eager')")
    assert "torch_compile=True" in block
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "tiled 2 MLPs" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]

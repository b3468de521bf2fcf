"""What the docs show as program output is what the program prints: the ``describe()`` table of
``docs/recognition.md`` is generated here from the code, for the model it names, and the README's Quickstart is run
and its output compared, line for line; and the README and docs speak to a reader of the repository: no link to a
file or heading that is not there, no issue numbers, no paths outside it, no names of the tools that measured."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tiledmlp

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("docs/recognition.md",)
#: every page a reader is sent to: the README and docs/
READER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_model() -> torch.nn.Module:
    """A Llama-3.2-1B-shaped model cut to 2 layers, bf16: on the meta device (describe() needs shapes), but for the
    MLPs, which the probe runs."""
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    torch.manual_seed(0)
    for layer in model.model.layers:
        layer.mlp.to_empty(device="cpu")
        for p in layer.mlp.parameters():
            torch.nn.init.normal_(p, std=0.02)
    return model


def documented_table(page: str) -> str:
    text = (ROOT / page).read_text()
    found = re.findall(r"```\n(tiled 2 MLPs.*?)\n```", text, re.S)
    assert len(found) == 1, f"{page}: expected one describe() block, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("page", PAGES)
def test_the_documented_describe_table_is_the_programs(page):
    generated = str(tiledmlp.describe(tiledmlp.enable_tiling(documented_model()), seq_len=131072))
    assert documented_table(page) == generated, f"{page} shows a stale table; the code prints:\n{generated}"


def test_the_quickstart_runs_and_prints_what_the_readme_shows(tmp_path):
    """The README's Quickstart is a whole script (before: a fragment with cfg, ids and hidden undefined), and the
    output shown under it is what it prints (before: a table of another model, 512 MiB shards for its 129)."""
    import os
    import subprocess
    import sys

    quickstart = re.search(r"## Quickstart\n.*?```python\n(.*?)```\n\nIt prints:\n\n```\n(.*?)```",
                           (ROOT / "README.md").read_text(), re.S)
    assert quickstart, "README.md: a Quickstart block followed by 'It prints:' and its output"
    block, shown = quickstart.groups()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout == shown, f"README.md shows a stale Quickstart output; the script prints:\n{proc.stdout}"


def _slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(page: Path) -> str:
    """``page`` without its code blocks (a link or heading inside one is code, not Markdown)."""
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page", READER_PAGES, ids=lambda p: p.name)
def test_every_link_leads_to_a_file_and_heading_of_the_repository(page):
    """Before: docs/integrations.md linked comparison.md, a page that never existed."""
    dead = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or ROOT not in dest.parents:
            dead.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in {
                _slug(h) for h in re.findall(r"^#+ (.*)$", _prose(dest), re.M)}:
            dead.append(target)
    assert not dead, f"{page.relative_to(ROOT)} links what the repository does not have: {dead}"


@pytest.mark.parametrize("page", READER_PAGES, ids=lambda p: p.name)
def test_no_internal_references(page):
    """A reader of the repository cannot follow an issue number, a path outside it, or the name of the tool a figure
    was measured through (before: "issue 41's method", `shared/house/today.png`, "one 10-minute device call")."""
    found = re.findall(r"\bissues? #?\d+|\bshared/[\w./-]*|\bdevice calls?\b", page.read_text(), re.I)
    assert not found, f"{page.relative_to(ROOT)}: {found}"


def test_the_version_is_the_changelogs():
    """The package, pyproject.toml and the newest CHANGELOG.md entry name one version."""
    newest = re.search(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    declared = re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert tiledmlp.__version__ == declared == newest, (tiledmlp.__version__, declared, newest)


def test_the_test_command_runs_the_paths_it_is_given(tmp_path):
    """``bash tests/run.sh PATH`` runs pytest on PATH only (before: PATH was added to the whole suite); options alone
    keep the default path. Run with a stand-in interpreter that prints what pytest would be given."""
    import os
    import stat
    import subprocess

    python = tmp_path / "python"
    python.write_text('#!/usr/bin/env bash\n[[ "$1" == "-m" ]] && echo "ARGS $*"\nexit 0\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)

    said = {}

    def pytest_args(*args: str) -> list[list[str]]:
        proc = subprocess.run(["bash", "tests/run.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHON=str(python), TILEDMLP_TEST_AXOLOTL="0"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        said[args] = proc.stdout
        return [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("ARGS ")]

    assert pytest_args("tests/unit/test_layout.py", "-x") == [["-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                               "tests/unit/test_layout.py", "-x"]]
    # the whole suite: the unit tests in two worker processes, then the distributed suite alone
    assert pytest_args("-k", "lora") == [
        ["-m", "pytest", "tests/unit", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "worksteal", "-k", "lora"],
        ["-m", "pytest", "tests/distributed", "-q", "-p", "no:cacheprovider", "-k", "lora"]]
    # the whole suite (CI's) says the Axolotl end-to-end script is skipped, and why; a path given runs that path only
    assert "[tests] scripts/test_axolotl.sh skipped: it installs Axolotl" in said[("-k", "lora")]
    assert "test_axolotl" not in said[("tests/unit/test_layout.py", "-x")]


def test_the_distributed_suite_runs_the_paths_it_is_given(tmp_path):
    """``launch/run_distributed_tests.sh NPROC PATH`` runs PATH only (before: PATH was added to the whole suite, so a
    GPU call meant for a few files ran the suite from its first file); options alone keep the whole suite."""
    import os
    import stat
    import subprocess

    python = tmp_path / "python"
    python.write_text('#!/usr/bin/env bash\n[[ "$1" == "-m" ]] && echo "ARGS $*"\nexit 0\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)

    def pytest_args(*args: str) -> list[str]:
        proc = subprocess.run(["bash", "launch/run_distributed_tests.sh", "2", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, env=dict(os.environ, PYTHON=str(python)))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return next(line for line in proc.stdout.splitlines() if line.startswith("ARGS ")).split()[1:]

    assert pytest_args("tests/distributed/test_sp.py", "-k", "ulysses") == [
        "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "tests/distributed/test_sp.py", "-k", "ulysses"]
    assert pytest_args("--durations=0") == ["-m", "pytest", "tests/distributed", "-v", "-rfE", "-p", "no:cacheprovider",
                                            "--durations=0"]

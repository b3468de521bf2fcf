"""The versions pyproject.toml claims are the versions CI tests: its floors are the lowest set's pins
(``scripts/versions/lowest.txt``), and both sets pin what the README's range names."""

import re
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CLAIMED = ("torch", "transformers", "peft", "trl")  # the newest set pins these; pip resolves the others after them


def pins(name: str) -> dict[str, str]:
    lines = (ROOT / "scripts" / "versions" / f"{name}.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))


def floors() -> dict[str, str]:
    """``{distribution: floor}`` of every ``>=`` requirement in pyproject.toml (dependencies and extras)."""
    found: dict[str, str] = {}
    for name, floor in re.findall(r'"([\w-]+)\s*>=\s*([\w.]+)', (ROOT / "pyproject.toml").read_text()):
        assert found.setdefault(name, floor) == floor, f"pyproject.toml gives {name} two floors"
    return found


def test_the_floors_are_the_lowest_set():
    tooling = {"setuptools", "pytest", "pytest-timeout", "pytest-xdist", "matplotlib"}  # not what CI tests against
    claimed = {name: Version(floor) for name, floor in floors().items() if name not in tooling}
    assert claimed == {name: Version(pin) for name, pin in pins("lowest").items()}


def test_the_newest_set_pins_the_claimed_packages():
    newest, lowest = pins("newest"), pins("lowest")
    assert set(CLAIMED) <= newest.keys()
    assert all(Version(version) > Version(lowest[name]) for name, version in newest.items())


def test_the_readme_states_the_tested_range():
    readme = (ROOT / "README.md").read_text()
    newest, lowest = pins("newest"), pins("lowest")
    for name in CLAIMED:
        assert f"{name} {lowest[name]}–{newest[name]}" in readme, f"README: '{name} {lowest[name]}–{newest[name]}'"

"""The package layout is the architecture (``docs/design.md``, "The packages"): each subpackage imports only what its
row of that table allows, no module imports another that imports it back, no module grows past ~400 lines without
saying why, and the import paths of the modules before the subpackages still import."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import tiledmlp

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tiledmlp"
MAX_LINES = 400
LONG_REASON = "Why this module is long:"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str) -> set[str]:
    """The tiledmlp modules ``name`` imports anywhere in its file (at the top, in functions; not under
    TYPE_CHECKING), each resolved to the module that defines the imported name."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                       for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def package_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else ""


def documented_layers() -> dict[str, set[str]]:
    """``{package: the packages it may import}`` from the table in docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)/` \| .*? \| (.*?) \|$", text, re.M)
    assert rows, "docs/design.md has no package table"
    order = [pkg for _, pkg in sorted(((int(n), pkg) for n, pkg, _ in rows))]
    allowed = {}
    for _, pkg, may in rows:
        if may == "everything below":
            allowed[pkg] = set(order[: order.index(pkg)])
        elif may == "nothing of tiledmlp":
            allowed[pkg] = set()
        else:
            allowed[pkg] = {re.match(r"\w+", item.strip()).group(0) for item in may.split(",")}
    return allowed


def test_the_documented_table_names_every_subpackage():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert set(documented_layers()) == subpackages


def test_each_subpackage_imports_only_what_its_row_allows():
    allowed = documented_layers()
    wrong = sorted((name, target) for name in MODULES if package_of(name)
                   for target in imported_modules(name)
                   if package_of(target) not in allowed[package_of(name)] | {package_of(name)})
    assert not wrong, f"imports the table in docs/design.md does not allow: {wrong}"


def test_no_import_circle():
    graph = {name: imported_modules(name) for name in MODULES}
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                raise AssertionError(f"import circle: {' -> '.join(trail[trail.index(target):] + [name, target])}")
            if target not in state:
                visit(target, trail + [name])
        state[name] = 2

    for name in MODULES:
        if name not in state:
            visit(name, [])


def test_every_subpackage_says_what_it_owns_and_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "mport" in doc, f"{init.relative_to(ROOT)}: a docstring saying what it owns and imports"


def test_long_modules_say_why():
    long = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
            if len(p.read_text().splitlines()) > MAX_LINES
            and LONG_REASON not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert not long, f"over {MAX_LINES} lines without '{LONG_REASON} ...' in the module docstring: {long}"


def test_old_import_paths_are_the_new_modules():
    for old, new in {**tiledmlp._MOVED, "describe": "patching.describe"}.items():
        assert importlib.import_module(f"tiledmlp.{old}") is importlib.import_module(f"tiledmlp.{new}")
    assert callable(tiledmlp.describe)  # the function, though its old module's path imports
    from tiledmlp.distributed import Wrapping, strategy_for  # the package exports what it did

    assert Wrapping is tiledmlp.distributed.detect.Wrapping
    assert strategy_for is tiledmlp.distributed.selection.strategy_for
    from tiledmlp.core.function import TiledMLPFunction as new
    from tiledmlp.function import TiledMLPFunction as old
    from tiledmlp.loss import tiled_linear_cross_entropy

    assert old is new and tiled_linear_cross_entropy is tiledmlp.tiled_linear_cross_entropy

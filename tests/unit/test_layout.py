"""The package layout is the architecture (``docs/design.md``, "The packages"): the table there says what each
subpackage owns (every module) and imports (exactly what its modules import, from floors below its own), no module
imports another that imports it back or a private name of another module, no module grows past ~400 lines without
saying why; and the import paths of versions before 0.5.0 are gone, with nothing of the project naming a path that
does not exist."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import tiledmlp

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tiledmlp"
MAX_LINES = 400
LONG_REASON = "Why this module is long:"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_sources(name: str) -> list[tuple[ast.stmt, str]]:
    """Each ``import``/``from ... import`` of module ``name`` (anywhere in its file) with the absolute module it
    imports from (``from ..a import b``: ``tiledmlp.a``; ``import a.b``: ``a.b``, once per alias)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[ast.stmt, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((node, ".".join(base + ([node.module] if node.module else []))))
            else:
                found.append((node, node.module or ""))
        elif isinstance(node, ast.Import):
            found.extend((node, alias.name) for alias in node.names)
    return found


def imported_modules(name: str) -> set[str]:
    """The tiledmlp modules ``name`` imports anywhere in its file (at the top, in functions; not under
    TYPE_CHECKING), each resolved to the module that defines the imported name."""
    found = set()
    for node, source in import_sources(name):
        if isinstance(node, ast.ImportFrom):
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                       for alias in node.names]
        else:
            targets = [source]
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_names_imported(name: str) -> set[str]:
    """The private names (``_x``, not ``__x__``) of other tiledmlp modules that module ``name`` imports (``from .a
    import _x``) or reads from a module it imported (``a._x``, ``tiledmlp.a._x``), each as ``module._x``."""
    found, modules = set(), {}
    for node, source in import_sources(name):
        for alias in node.names:
            if isinstance(node, ast.Import):
                if alias.name.split(".")[0] == "tiledmlp":  # import tiledmlp.a.b (as c)
                    modules[alias.asname or "tiledmlp"] = alias.name if alias.asname else "tiledmlp"
                continue
            full = f"{source}.{alias.name}"
            if full in MODULES:
                modules[alias.asname or alias.name] = full
            if source in MODULES and source != name and is_private(alias.name):
                found.add(full)
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in modules:
                target = ".".join([modules[value.id], *chain])
                if target in MODULES and target != name:
                    found.add(f"{target}.{node.attr}")
    return found


def package_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else ""


def table_rows() -> list[tuple[int, str, str, str]]:
    """``(floor, package, what it owns, what it may import)`` per row of the table in docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)/` \| (.*) \| (.*?) \|$", text, re.M)
    assert rows, "docs/design.md has no package table"
    return [(int(n), pkg, owns, may) for n, pkg, owns, may in rows]


def documented_layers() -> dict[str, set[str]]:
    """``{package: the packages it may import}`` from the table in docs/design.md."""
    return {pkg: set() if may == "nothing of tiledmlp" else {re.match(r"\w+", item.strip()).group(0)
                                                             for item in may.split(",")}
            for _, pkg, _, may in table_rows()}


def documented_floors() -> dict[str, int]:
    """``{package: its floor}`` from the table in docs/design.md."""
    return {pkg: floor for floor, pkg, _, _ in table_rows()}


def test_the_table_only_lets_a_package_import_floors_below_it():
    """No import up or across a floor: the clients on one floor (loss, attention, offload, recognize) do not import
    each other."""
    floors = documented_floors()
    wrong = sorted((pkg, other) for pkg, allowed in documented_layers().items() for other in allowed
                   if floors[other] >= floors[pkg])
    assert not wrong, f"docs/design.md lets these import a package on their floor or above: {wrong}"


def test_the_documented_table_names_every_subpackage():
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert set(documented_layers()) == subpackages


def test_each_subpackage_imports_only_what_its_row_allows():
    allowed = documented_layers()
    wrong = sorted((name, target) for name in MODULES if package_of(name)
                   for target in imported_modules(name)
                   if package_of(target) not in allowed[package_of(name)] | {package_of(name)})
    assert not wrong, f"imports the table in docs/design.md does not allow: {wrong}"


def test_each_row_allows_only_what_its_package_imports():
    """The table says what the code does: a package may import exactly what its modules import (an allowance no module
    uses is a row gone stale, as ``patching/``'s "everything below" was while it imports no kernel)."""
    imported: dict[str, set[str]] = {pkg: set() for pkg in documented_layers()}
    for name in MODULES:
        if package_of(name):
            imported[package_of(name)] |= {package_of(t) for t in imported_modules(name)} - {package_of(name), ""}
    stale = {pkg: sorted(allowed - imported[pkg]) for pkg, allowed in documented_layers().items()
             if allowed - imported[pkg]}
    assert not stale, f"docs/design.md lets these import packages they do not: {stale}"


def test_each_row_names_every_module_of_its_package():
    """The "owns" column of each row names each module of its package (before: the kernels' Triton modules were not)."""
    missing = {}
    for _, pkg, owns, _ in table_rows():
        named = set(re.findall(r"`(\w+)`", owns))
        modules = {p.stem for p in (PACKAGE / pkg).glob("*.py") if p.stem != "__init__"}
        if modules - named:
            missing[pkg] = sorted(modules - named)
    assert not missing, f"docs/design.md's table does not name these modules: {missing}"


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


def test_no_private_name_crosses_modules():
    found = {name: private_names_imported(name) for name in MODULES}
    wrong = sorted((name, private) for name, names in found.items() for private in names)
    assert not wrong, f"private names imported from another module (make them public, or move the code): {wrong}"


#: Import paths of tiledmlp 0.1.0's flat modules and names its old modules exported from the packages, removed in
#: 0.5.0 (CHANGELOG.md; docs/api.md has the table of their new paths): a sample of each kind.
REMOVED_MODULES = ("function", "runtime", "state", "heads", "tiled_forward", "logs")
REMOVED_NAMES = (("offload", "offloader_for"), ("distributed", "Wrapping"), ("forms", "Slot"),
                 ("loss", "tiled_linear_cross_entropy"), ("patching", "install"), ("attention", "attention_layers"))


@pytest.mark.parametrize("old", REMOVED_MODULES)
def test_an_old_module_path_is_gone(old):
    with pytest.raises(ModuleNotFoundError, match=f"tiledmlp.{old}"):
        importlib.import_module(f"tiledmlp.{old}")
    with pytest.raises(AttributeError, match=f"no attribute '{old}'"):
        getattr(tiledmlp, old)


@pytest.mark.parametrize("package,name", REMOVED_NAMES)
def test_an_old_package_name_is_gone(package, name):
    with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
        getattr(importlib.import_module(f"tiledmlp.{package}"), name)


def test_describe_is_the_function_only():
    """``tiledmlp.describe`` was also the old module's path: that path is gone (an import of it would have put the
    module where the function is)."""
    assert tiledmlp.describe is tiledmlp.patching.describe.describe
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tiledmlp.describe")
    assert tiledmlp.describe is tiledmlp.patching.describe.describe


def named_paths(path: Path) -> set[str]:
    """The ``tiledmlp`` paths a file names: modules imported, names imported from them, attributes read through
    ``tiledmlp.`` (``tiledmlp.a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "tiledmlp":
            found.update(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "tiledmlp")
        elif isinstance(node, ast.Attribute) and re.fullmatch(r"tiledmlp(\.\w+)+", ast.unparse(node)):
            found.add(ast.unparse(node))
    return found


def exists(dotted: str) -> bool:
    """Whether ``dotted`` is a tiledmlp module or a name in one (its longest importable prefix, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        if name not in MODULES and name != "tiledmlp":
            continue
        value = importlib.import_module(name)
        for attr in parts[cut:]:
            if not hasattr(value, attr):
                return False
            value = getattr(value, attr)
        return True
    return False


def test_the_project_names_no_path_that_is_gone():
    """Tests, benchmarks, scripts and the launcher import and read only tiledmlp paths that exist (before 0.5.0 the
    old ones still imported, with a warning; a module whose optional dependency is missing is not imported here)."""
    files = [p for folder in ("tests", "benchmarks", "scripts", "launch") for p in (ROOT / folder).rglob("*.py")]
    skip = {"tiledmlp.integrations.axolotl"}  # imports Axolotl, absent outside its own environment
    gone = {f"{path.relative_to(ROOT)}: {dotted}" for path in files for dotted in sorted(named_paths(path))
            if not any(dotted == s or dotted.startswith(s + ".") for s in skip) and not exists(dotted)}
    assert not gone, f"paths that do not exist: {sorted(gone)}"


#: a design note's title line in a module docstring, and a citation of one anywhere (wrapped over lines, in comments)
NOTE_TITLE = re.compile(r"^\s*\[Note: ([^\]]+)\]\s*$", re.M)
NOTE_CITED = re.compile(r"\[Note: ((?:[^\]\n]|\n[\s#:]*)+?)\]")


def test_every_note_is_written_once_and_every_citation_finds_it():
    """Design notes are ``[Note: title]`` blocks in the package's docstrings, cited by title from code, tests and docs
    (as FSDP2 cites its notes): a title written twice, or a citation no note answers, is a reader sent nowhere."""
    titles: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for title in NOTE_TITLE.findall(path.read_text()):
            titles.setdefault(title, []).append(name)
    assert titles and not {t: m for t, m in titles.items() if len(m) > 1}
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "docs").glob("*.md")]
    sources.remove(Path(__file__).resolve())  # its patterns are not citations
    cited = {(str(p.relative_to(ROOT)), re.sub(r"\s*\n[\s#:]*", " ", t)) for p in sources
             for t in NOTE_CITED.findall(p.read_text())}
    assert not sorted(c for c in cited if c[1] not in titles), "cited notes no module writes"
    assert not [str(p) for p in PACKAGE.rglob("*.py") if re.search(r"(?i)design note", p.read_text())], \
        "write a design note as [Note: title] and cite it by title"

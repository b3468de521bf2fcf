"""The package layout is the architecture (``docs/design.md``, "The packages"): each subpackage imports only what its
row of that table allows, no module imports another that imports it back or a private name of another module, no
module grows past ~400 lines without saying why, and the import paths of older versions still import, with a
``DeprecationWarning`` naming the new one, while nothing of the project uses them."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import tiledmlp
from tiledmlp._deprecated import MOVED_MODULES, MOVED_NAMES

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


def documented_floors() -> dict[str, int]:
    """``{package: its floor}`` from the table in docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    return {pkg: int(n) for n, pkg in re.findall(r"^\| (\d+) \| `(\w+)/` \|", text, re.M)}


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


MOVED_NAME_ROWS = [(package, module, name) for package, modules in MOVED_NAMES.items()
                   for module, names in modules.items() for name in names]


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_warns_once_and_is_the_new_module(old, monkeypatch):
    new = importlib.import_module(f"tiledmlp.{MOVED_MODULES[old]}")
    monkeypatch.delitem(vars(tiledmlp), old, raising=False)  # as if never imported: the warning is due again
    monkeypatch.delitem(sys.modules, f"tiledmlp.{old}", raising=False)
    said_as = rf"^tiledmlp\.{old} is deprecated and will be removed in tiledmlp 0\.5\.0: use {new.__name__}$"
    with pytest.warns(DeprecationWarning, match=said_as) as said:
        module = importlib.import_module(f"tiledmlp.{old}")
    assert module is new and new.__spec__.name == new.__name__
    assert len(said) == 1 and said[0].filename == __file__  # at the line that imported it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(f"tiledmlp.{old}") is new and getattr(tiledmlp, old) is new


def test_an_old_module_read_from_tiledmlp_warns(monkeypatch):
    monkeypatch.delitem(vars(tiledmlp), "logs", raising=False)
    monkeypatch.delitem(sys.modules, "tiledmlp.logs", raising=False)
    with pytest.warns(DeprecationWarning, match="use tiledmlp.core.logs") as said:
        from tiledmlp import logs
    assert logs is tiledmlp.core.logs and len(said) == 1 and said[0].filename == __file__
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        tiledmlp.nothing


@pytest.mark.parametrize("package,module,name", MOVED_NAME_ROWS)
def test_an_old_package_name_warns_once_and_is_the_defining_modules(package, module, name, monkeypatch):
    owner = importlib.import_module(f"tiledmlp.{package}")
    defined = getattr(importlib.import_module(f"tiledmlp.{package}.{module}"), name)
    monkeypatch.delitem(vars(owner), name, raising=False)
    said_as = rf"^tiledmlp\.{package}\.{name} is deprecated .*: use tiledmlp\.{package}\.{module}\.{name}$"
    with pytest.warns(DeprecationWarning, match=said_as) as said:
        value = getattr(owner, name)
    assert value is defined and len(said) == 1 and said[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(owner, name) is defined


def test_an_old_package_name_imported_warns_once(monkeypatch):
    monkeypatch.delitem(vars(tiledmlp.distributed), "Wrapping", raising=False)
    with pytest.warns(DeprecationWarning, match="use tiledmlp.distributed.detect.Wrapping") as said:
        from tiledmlp.distributed import Wrapping
    assert Wrapping is tiledmlp.distributed.detect.Wrapping and len(said) == 1 and said[0].filename == __file__
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        tiledmlp.distributed.nothing


def test_describe_is_the_function_only():
    """``tiledmlp.describe`` was also the old module's path: that path is gone (an import of it would have put the
    module where the function is)."""
    assert tiledmlp.describe is tiledmlp.patching.describe.describe
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("tiledmlp.describe")
    assert tiledmlp.describe is tiledmlp.patching.describe.describe


def test_the_new_paths_do_not_warn():
    """A fresh interpreter imports every module of tiledmlp by its own path (here they are imported already, and an
    import would run nothing): no tiledmlp DeprecationWarning. A module whose optional dependency is missing is
    passed over."""
    code = f"""
import importlib, warnings
warnings.filterwarnings("error", message=r"tiledmlp\\.\\S+ is deprecated", category=DeprecationWarning)
for name in {sorted(MODULES)!r}:
    try:
        importlib.import_module(name)
    except ImportError as e:  # an optional dependency missing (the Axolotl plugin says so in its own words)
        missing = e if isinstance(e, ModuleNotFoundError) else e.__cause__
        if not isinstance(missing, ModuleNotFoundError) or (missing.name or "").startswith("tiledmlp"):
            raise
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


OLD_PATHS = {f"tiledmlp.{old}" for old in MOVED_MODULES} | {f"tiledmlp.{package}.{name}"
                                                            for package, _, name in MOVED_NAME_ROWS}


def is_old(dotted: str) -> bool:
    return any(dotted == old or dotted.startswith(f"{old}.") for old in OLD_PATHS)


def old_paths_used(modules: list[str], names: list[str]) -> set[str]:
    """Of the modules imported and the dotted names imported or read, those that are old paths (the module
    ``tiledmlp.describe`` too; the name is the function)."""
    return ({m for m in modules if m == "tiledmlp.describe" or m.startswith("tiledmlp.describe.")}
            | {d for d in modules + names if is_old(d)})


def test_the_project_uses_no_old_path():
    """tiledmlp (relative imports resolved), its tests, benchmarks, scripts and launcher import only the new paths:
    ``tiledmlp.<old module>`` imported or read, ``tiledmlp.<package>.<name the old module exported>``."""
    used = {}
    for name in MODULES:
        sources = import_sources(name)
        used[name] = old_paths_used([source for _, source in sources],
                                    [f"{source}.{alias.name}" for node, source in sources
                                     if isinstance(node, ast.ImportFrom) for alias in node.names])
    files = [p for folder in ("tests", "benchmarks", "scripts", "launch") for p in (ROOT / folder).rglob("*.py")]
    for path in files:
        if path == Path(__file__).resolve():
            continue  # the tests of the old paths above
        modules, names = [], []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules.append(node.module)
                names += [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                modules += [alias.name for alias in node.names]
            elif isinstance(node, ast.Attribute) and re.fullmatch(r"tiledmlp(\.\w+)+", ast.unparse(node)):
                names.append(ast.unparse(node))
        used[str(path.relative_to(ROOT))] = old_paths_used(modules, names)
    used = {where: sorted(paths) for where, paths in used.items() if paths}
    assert not used, f"old import paths (tiledmlp/_deprecated.py has the new ones): {used}"


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

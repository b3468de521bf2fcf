"""Import paths of older versions, kept for one minor version: each warns with a ``DeprecationWarning`` naming the
new path from 0.4.0 and is removed in 0.5.0 (CHANGELOG.md, "Deprecated"; docs/api.md, "Import paths that changed").

* :data:`MOVED_MODULES` — the flat modules of tiledmlp 0.1.0, before the subpackages. ``import tiledmlp.function``
  gives the module that holds the code now (``tiledmlp.core.function``, the same object), through a finder on
  ``sys.meta_path``; ``tiledmlp.function`` read as an attribute does too.
* :data:`MOVED_NAMES` — what the old modules that are now packages exported (``tiledmlp.offload.offloader_for``):
  read from the package, each name is the defining module's.

Each old path warns once (then the module sits in ``sys.modules``, the name in the package), at the line of the
caller that imported or read it. tiledmlp's own code, tests, benchmarks and docs use the new paths only. Deleting
this module and its call in ``tiledmlp/__init__.py`` removes the old paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any, Callable

PACKAGE = "tiledmlp"
REMOVED_IN = "0.5.0"

#: ``{old module: new module}``, both under ``tiledmlp``.
MOVED_MODULES = {
    "function": "core.function", "accumulate": "core.accumulate", "sharding": "core.sharding",
    "compiled": "core.compiled", "logs": "core.logs",
    "mlp_form": "forms.mlp", "moe_form": "forms.moe", "lora": "forms.lora", "proj_form": "forms.proj",
    "quant": "forms.quant",
    "hooks": "distributed.hooks",
    "heads": "loss.heads", "lazy_logits": "loss.lazy_logits",
    "grouped_attention": "attention.grouped",
    "recognize_moe": "recognize.moe", "norms": "recognize.norms", "projections": "recognize.projections",
    "runtime": "patching.call_spec", "state": "patching.state", "planning": "patching.planning",
    "tiled_forward": "patching.forwards",
}

#: ``{package: {defining module: names}}``: what each package exported as an old module, and where each name is.
MOVED_NAMES = {
    "attention": {
        "layers": ("GroupedAttentionMode", "attention_layers", "attention_scopes", "install_attention",
                   "layer_stack", "reduce_layer_method", "uninstall_attention"),
        "norm_outputs": ("remember_norm_output",),
    },
    "distributed": {
        "detect": ("Wrapping", "detect_wrapping"),
        "selection": ("STRATEGIES", "STRATEGY_NAMES", "strategy_for", "validate_forced"),
        "strategies": ("Strategy",),
    },
    "forms": {"base": ("ModuleForm", "Slot", "is_plain_linear", "is_quantized", "swapped")},
    "loss": {"cross_entropy": ("REDUCTIONS", "CrossEntropySpec", "LinearCrossEntropyForm", "LogitTransform",
                               "linear_cross_entropy", "tiled_linear_cross_entropy")},
    "offload": {
        "checkpointing": ("OFFLOAD_TARGETS", "OffloadingCheckpointFunc", "checkpoint", "checkpointed_layers",
                          "install_offload", "offload_problems", "offloaded_layers", "offloader_for",
                          "uninstall_offload"),
        "host": ("HostOffload",),
    },
    "patching": {"patch": ("install", "tiled_names", "tiled_states", "uninstall")},
    "recognize": {
        "candidates": ("MLP_NAMES", "LinearLike", "Recognized", "activation_name", "hidden_sizes", "linear_like"),
        "mlp": ("recognize_mlp",),
        "probe": ("PROBE_ACTIVATIONS", "PROBE_RTOL"),
    },
}


def warn_moved(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in tiledmlp {REMOVED_IN}: use {new}",
                  DeprecationWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """``stacklevel`` for :func:`warn_moved`'s warning: the first frame outside this module and the import system,
    counted as ``warnings`` counts (it skips ``importlib._bootstrap`` frames)."""
    level, frame = 1, sys._getframe(2)  # warn_moved's caller, at level 2
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if "importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename:
            frame = frame.f_back
            continue
        level += 1
        if name != __name__ and name != "importlib":
            return level
        frame = frame.f_back
    return level


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports each old module path as its new module, warning once."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        old = fullname.partition(f"{PACKAGE}.")[2]
        if not fullname.startswith(f"{PACKAGE}.") or old not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        new = f"{PACKAGE}.{MOVED_MODULES[spec.name.partition('.')[2]]}"
        warn_moved(spec.name, new)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system sets the module's __spec__ to this one: restored
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state


def _moved_module_attribute(name: str) -> ModuleType:
    """``tiledmlp.<old module>`` read as an attribute of ``tiledmlp``."""
    if name in MOVED_MODULES:
        return importlib.import_module(f"{PACKAGE}.{name}")  # through the finder: warns the first time
    raise AttributeError(f"module {PACKAGE!r} has no attribute {name!r}")


def _moved_name_attribute(package: ModuleType, names: dict[str, tuple[str, ...]]) -> Callable[[str], Any]:
    where = {name: module for module, listed in names.items() for name in listed}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package.__name__!r} has no attribute {name!r}")
        module = f"{package.__name__}.{where[name]}"
        warn_moved(f"{package.__name__}.{name}", f"{module}.{name}")
        value = getattr(importlib.import_module(module), name)
        setattr(package, name, value)  # warned once: read from here on as any attribute
        return value

    return __getattr__


def install() -> Callable[[str], Any]:
    """Put the finder on ``sys.meta_path`` and each moved name's ``__getattr__`` on its package; returns the
    ``__getattr__`` of ``tiledmlp`` itself (for the old modules as attributes)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
    for package, names in MOVED_NAMES.items():
        module = importlib.import_module(f"{PACKAGE}.{package}")
        module.__getattr__ = _moved_name_attribute(module, names)
    return _moved_module_attribute

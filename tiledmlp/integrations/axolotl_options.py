"""The ``tiledmlp:`` section of an Axolotl config, read without Axolotl: :func:`tiling_options` (the section ->
``enable_tiling``'s keyword arguments) and :func:`check_config` (the settings refused beside tiledmlp, each with its
fix). ``tiledmlp.integrations.axolotl`` (the plugin) calls both; they take the config as a mapping (Axolotl's
``DictDefault``, or the YAML's dict), so they run, and are tested, where Axolotl is not installed. Reading a config
costs nothing worth counting (``mlp_types`` imports the classes it names).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch

from ..plan.arguments import OFFLOADS
from ..plan.options import OPTION_NAMES, SWITCHES

__all__ = ["SECTION", "OPTIONS", "tiling_options", "check_config"]

#: the key of the section in an Axolotl config
SECTION = "tiledmlp"

#: the keys the section takes: ``enable_tiling``'s options (``tiledmlp.TilingOptions``' fields), one for one
OPTIONS = OPTION_NAMES

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _section(cfg: Mapping[str, Any]) -> dict[str, Any]:
    section = cfg.get(SECTION)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ValueError(f"the {SECTION}: section of the Axolotl config is a mapping of enable_tiling's options "
                         f"({', '.join(OPTIONS)}), got {section!r}")
    unknown = sorted(set(section) - set(OPTIONS))
    if unknown:
        raise ValueError(f"{SECTION}: {', '.join(map(str, unknown))}: not "
                         f"{'an option' if len(unknown) == 1 else 'options'} of enable_tiling; the section takes "
                         f"{', '.join(OPTIONS)}")
    return {key: value for key, value in section.items() if value is not None}


def _dtype(key: str, value: Any) -> torch.dtype:
    name = value.removeprefix("torch.") if isinstance(value, str) else None
    if name not in _DTYPES:
        raise ValueError(f"{SECTION}: {key} is one of {', '.join(_DTYPES)} (or null for enable_tiling's default), "
                         f"got {value!r}")
    return _DTYPES[name]


def _module_type(path: Any) -> type:
    module, _, name = path.rpartition(".") if isinstance(path, str) else ("", "", "")
    if not module:
        raise ValueError(f"{SECTION}: mlp_types lists nn.Module classes by import path (e.g. my_models.blocks.MyMLP), "
                         f"got {path!r}")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError as missing:
        raise ValueError(f"{SECTION}: mlp_types: {path} does not import ({missing})") from missing
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        raise ValueError(f"{SECTION}: mlp_types: {path} is not an nn.Module class")
    return found


def _seq_len(value: Any, cfg: Mapping[str, Any]) -> int:
    if value == "auto":
        length = cfg.get("sequence_len")
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"{SECTION}: seq_len: auto plans for Axolotl's sequence_len, which this config does not "
                             f"set (got {length!r}): set sequence_len, or give seq_len as a number of tokens")
        return length * int(cfg.get("micro_batch_size") or 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{SECTION}: seq_len is the tokens of one step to plan the memory for (a positive number) "
                         f"or auto (sequence_len x micro_batch_size), got {value!r}")
    return value


def tiling_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``enable_tiling``'s keyword arguments from the ``tiledmlp:`` section of ``cfg`` (no section, or an empty one:
    ``{}``, the defaults). Keys and values are ``enable_tiling``'s, written in YAML: ``grad_accum_dtype`` and
    ``loss_grad_accum_dtype`` by name (``float32``, ``bfloat16``, ``float16``), ``mlp_types`` as import paths of
    classes, a null value as the key left out. ``seq_len: auto`` plans for the tokens of one micro-batch,
    ``sequence_len x micro_batch_size`` (no ``seq_len``: no plan, the options as given). ValueError naming the valid
    keys or values for one it cannot read; the values ``enable_tiling`` checks itself are checked when it runs."""
    options = _section(cfg)
    for key in ("grad_accum_dtype", "loss_grad_accum_dtype"):
        if key in options:
            options[key] = _dtype(key, options[key])
    if "mlp_types" in options:
        paths = options["mlp_types"]
        options["mlp_types"] = tuple(_module_type(p) for p in ([paths] if isinstance(paths, str) else paths))
    if "seq_len" in options:
        options["seq_len"] = _seq_len(options["seq_len"], cfg)
    for key in SWITCHES:
        if key in options and not isinstance(options[key], bool):
            raise ValueError(f"{SECTION}: {key} is true or false, got {options[key]!r}")
    if options.get("offload") not in OFFLOADS:
        raise ValueError(f"{SECTION}: offload is cpu, auto or null, got {options['offload']!r}")
    return options


def _checkpointing_refusal(cfg: Mapping[str, Any], options: dict[str, Any]) -> str:
    """Why the layers will not checkpoint as ``offload`` and ``seq_len`` need ("" when they will)."""
    wants = [f"{k}: {options[k]}" for k in ("offload", "seq_len") if k in options]
    if not wants:
        return ""
    needs = (f"{SECTION}: {' and '.join(wants)} needs the layers checkpointed by torch's non-reentrant checkpointing "
             f"(its layer inputs are what it places): ")
    kwargs = cfg.get("gradient_checkpointing_kwargs") or {}
    if cfg.get("gradient_checkpointing") is not True:
        return needs + (f"gradient_checkpointing is {cfg.get('gradient_checkpointing')!r}; set gradient_checkpointing: "
                        f"true and gradient_checkpointing_kwargs: {{use_reentrant: false}}")
    if kwargs.get("use_reentrant") is not False:
        return needs + ("Axolotl checkpoints reentrantly unless told otherwise; set gradient_checkpointing_kwargs: "
                        "{use_reentrant: false}")
    if cfg.get("activation_offloading"):
        return needs + (f"activation_offloading: {cfg.get('activation_offloading')} replaces it with Axolotl's own; "
                        f"offload with one of the two: activation_offloading: false, or leave out "
                        f"{' and '.join(k for k in ('offload', 'seq_len') if k in options)}")
    return ""


def check_config(cfg: Mapping[str, Any]) -> None:
    """Refuse, with the fix named, what must not run beside tiledmlp in one Axolotl config (``cfg``, as given or as
    Axolotl validated it): Axolotl's ``tiled_mlp`` (DeepSpeed's TiledMLP, a second tiling of the MLPs, whose
    parameter gradients are wrong under ZeRO-3, DDP and ``no_sync``: docs/distributed.md, "Failure modes"); a fused
    loss of another library (Liger's ``liger_fused_linear_cross_entropy``, ``cut_cross_entropy``) while tiledmlp tiles
    the loss (its default); ``offload`` or ``seq_len`` without torch's non-reentrant checkpointing; a ``tiledmlp:``
    section :func:`tiling_options` cannot read. ValueError; returns nothing."""
    options = tiling_options(cfg)
    if cfg.get("tiled_mlp"):
        raise ValueError("tiledmlp and Axolotl's tiled_mlp (DeepSpeed's TiledMLP) both tile the MLP: set tiled_mlp: "
                         "false (tiledmlp tiles every MLP Axolotl's would, exactly under DDP, FSDP and ZeRO-3), or "
                         "remove tiledmlp.integrations.axolotl.TiledMLPPlugin from plugins")
    if options.get("loss") is not False:
        for key, who in (("liger_fused_linear_cross_entropy", "Liger's fused linear cross-entropy"),
                         ("cut_cross_entropy", "Cut Cross-Entropy")):
            if cfg.get(key):
                raise ValueError(f"tiledmlp tiles the loss (LM head + cross-entropy) and {key}: true fuses it with "
                                 f"{who}: tile the loss with one of the two — set {key}: false, or {SECTION}: "
                                 f"{{loss: false}} to keep {who} (tiledmlp then tiles the MLPs only)")
    refusal = _checkpointing_refusal(cfg, options)
    if refusal:
        raise ValueError(refusal)

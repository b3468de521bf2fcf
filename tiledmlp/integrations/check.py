"""``tiledmlp-doctor`` (``python -m tiledmlp``): what this machine has — package versions,
devices, the host memory this process may take —, what ``enable_tiling`` would do to a model given by its config
(which modules it tiles, with which form, and the memory plan for a length), and which known conflicts are present
(:func:`conflicts`: patches of Liger-Kernel, DeepSpeed's or Axolotl's tiled MLP, Unsloth, in a model).

A model is built from its config only, never downloaded weights: a one-layer twin with random weights on the CPU
for what ``enable_tiling`` recognizes (every layer of a decoder is the same), and the full model on the meta device
for the plan (nothing allocated). Costs the twin's build (about 1 GB of host memory for an 8B layer in bf16). What it
cannot read (a config that is not there, a hub id offline) or an option ``enable_tiling`` refuses ends the command in
one line naming the fix.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..core.compat import enable_checkpointing
from ..offload.host_memory import available_host_bytes
from ..patching.describe import describe
from ..patching.enable import enable_tiling
from ..plan.options import PLAN_INPUTS, PLANNED_OPTIONS, TilingOptions
from ..plan.plans import plan_memory

__all__ = ["PACKAGES", "PATCHERS", "TILED_ELSEWHERE", "ConfigUnreadable", "conflicts", "environment", "model_report",
           "main"]

#: the distributions whose versions matter to tiledmlp (the torch stack, the extras, the tools it meets)
PACKAGES = ("tiledmlp", "torch", "triton", "transformers", "peft", "accelerate", "trl", "deepspeed", "bitsandbytes",
            "liger-kernel", "axolotl", "unsloth")

#: packages that patch what a model computes where tiledmlp tiles (by the top-level module their code lives in),
#: and what to do about it
PATCHERS = {
    "liger_kernel": "Liger-Kernel patched it (fused linear cross-entropy in the LM head's forward, its SwiGLU or "
                    "RMSNorm): tile the loss with one of the two — enable_tiling(loss=False) beside Liger's fused "
                    "loss, or apply_liger_kernel_to_*(fused_linear_cross_entropy=False) beside tiledmlp's",
    "deepspeed": "DeepSpeed's TiledMLP (ALST) computes it: its parameter gradients are wrong under ZeRO-3, DDP and "
                 "no_sync (docs/distributed.md, 'Failure modes'); leave it out and let enable_tiling tile the MLP",
    "axolotl": "Axolotl patched it (tiled_mlp: true uses DeepSpeed's TiledMLP): set tiled_mlp: false and load "
               "tiledmlp's plugin instead",
    "arctic_training": "ArcticTraining patched it (DeepSpeed's TiledMLP): turn its tiled MLP off and let "
                       "enable_tiling tile the MLP",
    "unsloth": "Unsloth patched it (its fused forwards and gradient checkpointing): tiledmlp does not tile a model "
               "Unsloth patched; load the model without Unsloth's patches",
    "unsloth_zoo": "Unsloth patched it (its fused forwards and gradient checkpointing): tiledmlp does not tile a "
                   "model Unsloth patched; load the model without Unsloth's patches",
}


def _origin(obj: Any) -> str:
    """The top-level package an object's code lives in ("" when unknown)."""
    module = getattr(obj, "__module__", None) or getattr(getattr(obj, "__func__", None), "__module__", None) or ""
    return module.partition(".")[0]


#: names a forward calls that are another library's tiled computation (DeepSpeed's, as its ALST tutorial, Axolotl
#: and ArcticTraining patch it into an MLP's forward), whichever module that forward was written in
TILED_ELSEWHERE = ("TiledMLP", "TiledFusedLogitsLoss")


def _calls_tiled_elsewhere(forward: Any) -> bool:
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    return code is not None and any(name in code.co_names + code.co_freevars for name in TILED_ELSEWHERE)


def conflicts(model: nn.Module) -> dict[str, str]:
    """``{qualified module name: what patched it, and the fix}`` for each module of ``model`` whose ``forward`` comes
    from a package of :data:`PATCHERS` while its class does not (a patched forward) or calls DeepSpeed's tiled
    computations (:data:`TILED_ELSEWHERE`), or whose class comes from one (a replaced module). Reads the model;
    changes nothing."""
    found = {}
    for name, module in model.named_modules():
        cls_origin = _origin(type(module))
        forward = module.__dict__.get("forward", type(module).forward)
        forward_origin = _origin(forward)
        if _calls_tiled_elsewhere(forward) and forward_origin != "tiledmlp":
            found[name or type(module).__name__] = f"{type(module).__name__}.forward: {PATCHERS['deepspeed']}"
        elif forward_origin in PATCHERS and forward_origin != cls_origin:
            found[name or type(module).__name__] = f"{type(module).__name__}.forward: {PATCHERS[forward_origin]}"
        elif cls_origin in PATCHERS and cls_origin != "deepspeed":  # DeepSpeed's engine is a wrapper, not a patch
            found[name or type(module).__name__] = f"{type(module).__name__}: {PATCHERS[cls_origin]}"
    return found


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> str:
    """Versions, devices and host memory, in lines."""
    versions = {d: _version(d) for d in PACKAGES}
    lines = [f"Python {platform.python_version()} on {platform.system()} {platform.machine()}",
             "installed: " + ", ".join(f"{d} {v}" for d, v in versions.items() if v),
             "not installed: " + (", ".join(d for d, v in versions.items() if not v) or "-")]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(index)
            lines.append(f"cuda:{index}: {torch.cuda.get_device_name(index)}, {total / 2**30:.1f} GiB "
                         f"({free / 2**30:.1f} free), CUDA {torch.version.cuda}")
    else:
        lines.append(f"no CUDA device (torch {torch.__version__}): tiled steps run on the CPU")
    host = available_host_bytes()
    lines.append(f"host memory this process may take: {'unknown' if host is None else f'{host / 2**30:.1f} GiB'}")
    present = [d for d in ("liger-kernel", "unsloth", "axolotl") if versions.get(d)]
    if present:
        lines.append(f"installed packages that may patch models: {', '.join(present)} (a model's own patches: "
                     "tiledmlp.integrations.check.conflicts(model))")
    return "\n".join(lines)


class ConfigUnreadable(Exception):
    """The config of ``--model`` could not be read (a path that is not there, a hub id offline): one line, the fix."""


def _load_config(source: str) -> Any:
    from transformers import AutoConfig

    path = Path(source)
    if path.is_file():  # a config.json
        return AutoConfig.from_pretrained(str(path.parent)) if path.name == "config.json" else \
            AutoConfig.for_model(**json.loads(path.read_text()))
    if not path.exists() and (source.startswith(("/", ".", "~")) or source.endswith(".json")):
        raise ConfigUnreadable(f"{source!r} does not exist: pass a config.json, a directory holding one, or a model "
                               "id (its config is read from the local cache or the Hugging Face Hub)")
    try:
        return AutoConfig.from_pretrained(source)  # a directory, or a model id in the local cache or on the hub
    except OSError as error:  # transformers' word for "not here, not reachable": its first line says which
        said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigUnreadable(f"could not read the config of {source!r}: {said} Pass a local config instead: "
                               "--model path/to/config.json, or a directory holding one") from None


def _checkpointed(model: nn.Module) -> nn.Module:
    """``model`` with non-reentrant checkpointing per layer, as a long-context run trains it (``offload`` and the
    plan need it)."""
    enable_checkpointing(model)
    return model


def _twin(config: Any) -> nn.Module:
    """One decoder layer of ``config``'s causal LM, random weights, on the CPU, checkpointed (what ``enable_tiling``
    recognizes is the same in every layer)."""
    from transformers import AutoModelForCausalLM

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    small = type(config).from_dict({**config.to_dict(), "num_hidden_layers": 1})
    if text is not config:
        small.get_text_config().num_hidden_layers = 1
    torch.manual_seed(0)
    return _checkpointed(AutoModelForCausalLM.from_config(small, dtype=torch.bfloat16))


def model_report(source: str, seq_len: Optional[int] = None, **options: Any) -> str:
    """What ``enable_tiling(model, **options)`` would do to the causal LM of config ``source`` (a ``config.json``,
    a directory, or a model id), and the memory plan of a step of ``seq_len`` tokens on this machine."""
    from transformers import AutoModelForCausalLM

    config = _load_config(source)
    layers = config.get_text_config().num_hidden_layers
    twin = _twin(config)
    found = conflicts(twin)
    # checked as enable_tiling checks them; the length and the budgets are the whole model's plan's
    tiled = enable_tiling(twin, options=TilingOptions.from_kwargs({k: v for k, v in options.items()
                                                                   if k not in PLAN_INPUTS}))
    given = ", ".join(f"{k}={v!r}" for k, v in options.items())
    modules = describe(tiled, seq_len)
    modules.memory = None  # the one-layer twin's plan: not the model's (planned whole below)
    lines = [f"{source}: {type(twin).__name__}, {layers} layers; "
             f"enable_tiling(model{', ' + given if given else ''}) would tile (one layer shown: every layer is alike):",
             str(modules)]
    lines += [f"conflict: {name}: {why}" for name, why in found.items()]
    if seq_len:
        with torch.device("meta"):
            full = _checkpointed(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))
        planned = TilingOptions(**{k: v for k, v in options.items() if k in PLANNED_OPTIONS or k in PLAN_INPUTS})
        plan = plan_memory(full, seq_len, options=planned)
        lines += [f"The whole model's memory plan on this machine ({layers} layers, bf16 weights and gradients, "
                  "checkpointed layers, no optimizer states):", str(plan)]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tiledmlp-doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a config.json, a model directory, or a model id (its config only)")
    parser.add_argument("--seq-len", type=int, default=None, help="plan the memory of a step of this many tokens")
    parser.add_argument("--options", default="{}",
                        help='enable_tiling\'s options as JSON, e.g. \'{"norms": true, "attention": true}\'')
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as error:
        parser.error(f"--options takes a JSON object of enable_tiling's options: {error}")
    if not isinstance(options, dict):
        parser.error("--options takes a JSON object of enable_tiling's options")
    if args.seq_len and not args.model:
        parser.error("--seq-len plans a model's step: give --model too")
    print(environment())
    if args.model:
        try:
            report = model_report(args.model, args.seq_len, **options)
        except ConfigUnreadable as error:
            parser.exit(1, f"{parser.prog}: {error}\n")
        except (TypeError, ValueError) as error:  # the options refused, as enable_tiling and plan_memory say it
            parser.exit(2, f"{parser.prog}: --options {args.options}: {error}\n")
        print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The tiled loss of Hugging Face causal LMs, by instance patching: no copy of any model's forward.

For each causal LM in the model (a ``PreTrainedModel`` whose loss is transformers' ``ForCausalLMLoss``
and whose output embedding is a plain ``nn.Linear``), ``enable_tiling(model, loss=True)`` patches
three things on the instances, and ``disable_tiling`` undoes them:

* the head's ``forward`` (like a tiled MLP's): during a model call that was given ``labels`` it
  returns a :class:`~tiledmlp.loss.lazy_logits.LazyLogits` placeholder instead of computing the logits;
  otherwise (generation, evaluation without labels) the real logits, as before;
* the model's ``loss_function`` (transformers 5 lets an instance own it): given a placeholder, it
  computes ``ForCausalLMLoss``'s loss — label shifting, ``shift_labels``, ``ignore_index``,
  ``num_items_in_batch`` — with the tiled linear cross-entropy, folding what the model applied to the
  logits in between (Gemma's softcap, Granite's scaling) into the loss; given real logits, it is
  ``ForCausalLMLoss`` itself;
* a forward pre-hook and an always-called forward hook on the model, which tell the head whether the
  current call has labels.

A model that applies to its logits, before the loss, anything the loss cannot fold exactly (the
placeholder then had to be materialized) is refused with a ``ValueError`` at that call, never
approximated. The head is tiled with the strategy of its wrapping (``tiled_modules`` lists it).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core.function import in_shard
from ..core.logs import set_traced, warn_once, warn_once_traced
from ..distributed.context_parallel import check_grouped_kv_under_cp
from ..distributed.sequence_parallel import SequenceSplit, split_of
from ..forms.base import Slot, is_plain_linear, is_quantized, parametrized
from .cross_entropy import CrossEntropySpec, linear_cross_entropy
from .lazy_logits import LazyLogits, LogitsRecipe, lazy_logits

__all__ = ["LossOptions", "LossOwner", "HeadSpec", "find_causal_lms", "TiledHeadForward", "OWNER_ATTR",
           "UNTILED_TRAINING_CALL"]

OWNER_ATTR = "_tiledmlp_loss_owner"
#: ``TilingState.fallback`` of a head once a training call without labels computed real logits
UNTILED_TRAINING_CALL = "training calls without labels compute the full logits (the caller computes the loss)"
#: ``TilingState.fallback`` of a head called inside a torch.compile'd region (the whole model compiled)
COMPILED_HEAD = "called inside a torch.compile'd region: full logits, untiled loss"
#: ``TilingState.fallback`` of a head with full backward hooks of its own
HOOKED_HEAD = "backward hooks on the head take the logits' gradient: full logits, untiled loss"
#: ``TilingState.fallback`` of a head parametrized since enable_tiling (``check_causal_lm`` refuses one before)
PARAMETRIZED_HEAD = "its weight is parametrized, which the tiled loss does not follow: full logits, untiled loss"


def _causal_lm_loss() -> Optional[Callable[..., torch.Tensor]]:
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:
        return None
    return LOSS_MAPPING.get("ForCausalLM")


@dataclass(frozen=True)
class LossOptions:
    """``enable_tiling``'s loss options: ``loss_scratch_mib``, ``loss_mode``, ``loss_grad_accum_dtype``."""

    scratch_mib: Optional[float] = None
    mode: str = "auto"
    grad_accum_dtype: Optional[torch.dtype] = torch.float32


@dataclass
class _Call:
    """One call of the model: whether it has labels, which op (if any) materialized its logits, and the
    release of a head unit its strategy keeps gathered for the loss (``Strategy.hold_gathered``)."""

    labels: bool
    materialized_by: Optional[str] = None
    release: Optional[Callable[[], None]] = None

    def release_head(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            release()


@dataclass
class LossOwner:
    """Patch state kept on the causal LM module (``OWNER_ATTR``)."""

    name: str  # for messages
    module_name: str  # the model's qualified name in the tree enable_tiling was given
    head: nn.Module
    labels_index: Optional[int]  # position of ``labels`` among the forward's positional parameters
    had_loss_function: bool = False  # whether the instance owned a loss_function before patching
    saved_loss_function: Any = None
    handles: list = field(default_factory=list)
    calls: list = field(default_factory=list)  # the model calls in progress (innermost last)
    # Called with the model when its output layer is no longer ``head`` (resize_token_embeddings replaces an
    # untied head): moves the tiling to the new one (``patching``), or says why it cannot.
    on_new_head: Optional[Callable[[nn.Module], None]] = None
    # Why the loss is computed untiled from now on ("" while it is tiled): the output layer was replaced by one the
    # tiled loss cannot compute (a LoRA-wrapped head, which calls ``head`` as its base layer and adds to its output)
    untiled: str = ""

    def follow_head(self, lm: nn.Module) -> None:
        """Move the tiling to ``lm``'s output layer if it is no longer ``head`` (see ``on_new_head``)."""
        if self.on_new_head is not None and lm.get_output_embeddings() is not self.head:
            self.on_new_head(lm)

    def wants_placeholder(self) -> bool:
        # len, not bool(list): Dynamo traces it (torch 2.11)
        return not self.untiled and len(self.calls) > 0 and self.calls[-1].labels

    def materialized(self, op: str) -> None:
        if self.calls and self.calls[-1].materialized_by is None:
            self.calls[-1].materialized_by = op

    def __getstate__(self) -> dict:  # a copy is made at rest: no call in progress
        return {**self.__dict__, "calls": []}


@dataclass
class HeadSpec:
    """What a tiled head computes: the ``spec`` of its tiling state (name and parameter slots, like an
    MLP's), its loss options, and the model that owns its loss."""

    name: str
    slots: tuple[Slot, ...]
    options: LossOptions
    owner: LossOwner

    def params(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        weight = self.slots[0].get()
        return weight, self.slots[1].get() if len(self.slots) > 1 else None


# ----------------------------------------------------------------------------------------------
# Recognition


def find_causal_lms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost modules of ``model`` that own a ``loss_function`` (a transformers ``PreTrainedModel``)
    and an output embedding; :func:`check_causal_lm` then says whether their loss can be tiled."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == n or name.startswith(n + ".") or n == "" for n, _ in found):
            continue
        get_head = getattr(module, "get_output_embeddings", None)
        if callable(get_head) and hasattr(type(module), "loss_function") and get_head() is not None:
            found.append((name, module))
    return found


def check_causal_lm(name: str, module: nn.Module) -> nn.Linear:
    """The head of a causal LM that can be tiled; ``ValueError`` naming the fix otherwise."""
    label = name or type(module).__name__
    head = module.get_output_embeddings()
    if not is_plain_linear(head) and is_quantized(getattr(head, "weight", None)):
        raise ValueError(
            f"{label}: its output layer is a quantized {type(head).__name__}; the tiled loss computes the head in "
            "full precision. Load the model with the head unquantized (bitsandbytes' default; "
            "BitsAndBytesConfig(llm_int8_skip_modules=[..., 'lm_head']) keeps it so when you name modules) or "
            "enable tiling with loss=False.")
    if parametrized(head):
        raise ValueError(
            f"{label}: its output layer is {parametrized(head)}: its weight is computed from the parametrization's "
            "parameters at each read, which the tiled loss does not follow. Remove it "
            "(torch.nn.utils.parametrize.remove_parametrizations) or enable tiling with loss=False.")
    if not is_plain_linear(head):
        raise ValueError(
            f"{label}: its output layer is a {type(head).__name__}, not a plain nn.Linear (a LoRA- or "
            "quantization-wrapped head?); the tiled loss computes the head itself and cannot reproduce it. "
            "Leave the head untouched by the adapter (e.g. drop lm_head from target_modules/modules_to_save) "
            "or enable tiling with loss=False.")
    # Already patched: its own loss function was checked then (and is saved in its owner state).
    current = module.loss_function if OWNER_ATTR not in module.__dict__ else _causal_lm_loss()
    if current is None or current is not _causal_lm_loss():
        raise ValueError(
            f"{label}: its loss_function is {getattr(current, '__name__', current)!r}, not transformers' "
            "ForCausalLMLoss; the tiled loss reproduces ForCausalLMLoss only. Enable tiling with loss=False "
            "and call tiledmlp.tiled_linear_cross_entropy in your own loss.")
    return head


def labels_position(module: nn.Module) -> Optional[int]:
    """Index of ``labels`` among the positional arguments of ``module``'s forward (None: keyword only)."""
    params = [p for p in inspect.signature(type(module).forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]  # without self
    return next((i for i, p in enumerate(params) if p.name == "labels"), None)


# ----------------------------------------------------------------------------------------------
# The patches


class _CallStart:
    """Forward pre-hook on the model: opens a call record saying whether labels were passed."""

    def __init__(self, owner: LossOwner) -> None:
        self.owner = owner

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.owner.follow_head(module)
        index = self.owner.labels_index
        labels = kwargs.get("labels", args[index] if index is not None and len(args) > index else None)
        split = split_of(module)
        if split is not None:
            if labels is not None and kwargs.get("shift_labels") is None:
                _refuse_unshifted_labels(self.owner.name, split)
            check_grouped_kv_under_cp(module, split)  # before torch's ring fails on it, naming the fix
        self.owner.calls.append(_Call(labels is not None))


def _refuse_unshifted_labels(name: str, split: SequenceSplit) -> None:
    """Labels given to a rank's part of a split sequence are shifted by the loss within that part: the label of
    each part's last token (the next part's first) would be lost. Refused, naming the fix."""
    how = "Ulysses" if split.kind == "sp" else "context parallelism"
    raise ValueError(
        f"{name}: its sequence is split across {split.size} ranks ({how}) and it was called with labels but no "
        "shift_labels: shifted within this rank's part, the labels would lose every part's last target. Shift "
        "them before the split and pass shift_labels (what DeepSpeed's UlyssesSPDataLoaderAdapter and the "
        "Trainer do), or use tiledmlp.sequence_loss.")


class _CallEnd:
    """Always-called forward hook on the model: closes the call record (also when forward raised)."""

    def __init__(self, owner: LossOwner) -> None:
        self.owner = owner

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.owner.calls:
            self.owner.calls.pop().release_head()  # the loss released it already, unless it raised


class TiledHeadForward:
    """The instance ``forward`` of a tiled head: a logits placeholder while the model computes a loss."""

    __slots__ = ("state", "original")

    def __init__(self, state: Any, original: Callable[..., Any]) -> None:
        self.state = state  # the head's TilingState (spec: HeadSpec)
        self.original = original  # the head's forward before patching

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec: HeadSpec = self.state.spec
        owner = spec.owner
        x = args[0] if args else kwargs.get("input")
        if owner.head._backward_hooks or owner.head._backward_pre_hooks:
            self._said_hooked(spec.name)
            return self.original(*args, **kwargs)
        if "parametrizations" in owner.head._modules:  # weight_norm & co. registered since enable_tiling
            self._said_parametrized(spec.name)
            return self.original(*args, **kwargs)
        if (not owner.wants_placeholder() or in_shard() or len(args) + len(kwargs) != 1
                or not isinstance(x, torch.Tensor) or x.dim() < 2 or torch.compiler.is_compiling()):
            if (owner.calls and not owner.calls[-1].labels and owner.head.training and torch.is_grad_enabled()
                    and not torch.compiler.is_compiling()):
                self._said_untiled(spec.name)
            return self.original(*args, **kwargs)
        weight, bias = spec.params()
        call = owner.calls[-1]
        call.release_head()  # a second head call in one model call: the first one's hold ends
        call.release = self.state.choice.strategy(owner.head).hold_gathered(owner.head)
        return lazy_logits(LogitsRecipe(x, weight, bias, on_materialize=owner.materialized))

    def _said_untiled(self, name: str) -> None:
        """A training call without labels: the caller will compute a loss from real logits (the ``Trainer`` with
        ``label_smoothing_factor`` or ``compute_loss_func`` takes the labels out of the model's call)."""
        self.state.fallback = UNTILED_TRAINING_CALL
        warn_once(("head without labels", name), "%s: the model was called for training without labels, so its head "
                  "computed the T x vocab logits (the tiled loss needs the labels in the model's call). The "
                  "Trainer's label_smoothing_factor and compute_loss_func take them out: drop those (or compute the "
                  "loss from the hidden states with tiledmlp.tiled_linear_cross_entropy, which takes "
                  "label_smoothing) to keep the loss tiled.", name)

    def _said_hooked(self, name: str) -> None:
        """Full backward hooks on the head take the logits' gradient, which the tiled loss never makes."""
        self.state.fallback = HOOKED_HEAD
        warn_once(("hooked head", name), "%s: backward hooks are registered on it (register_full_backward_hook or "
                  "its pre-hook), which take the T x vocab logits' gradient: its calls compute the full logits and "
                  "the untiled loss. Remove the hooks to keep the loss tiled.", name)

    def _said_parametrized(self, name: str) -> None:
        """A parametrization registered on the head since ``enable_tiling``: its weight is computed at each read."""
        self.state.fallback = PARAMETRIZED_HEAD
        warn_once(("parametrized head", name), "%s: it is %s since enable_tiling, so its calls compute the full logits "
                  "and the untiled loss. Remove the parametrization (torch.nn.utils.parametrize."
                  "remove_parametrizations) to keep the loss tiled.", name, parametrized(self.state.spec.owner.head))

    def __reduce__(self):
        return (TiledHeadForward, (self.state, self.original))


class TiledCausalLMLoss:
    """The model instance's ``loss_function``: ``ForCausalLMLoss``, tiled when given a placeholder."""

    __slots__ = ("head_state",)

    def __init__(self, head_state: Any) -> None:
        self.head_state = head_state  # the head's TilingState (spec: HeadSpec)

    def __reduce__(self):
        return (TiledCausalLMLoss, (self.head_state,))

    def __call__(self, logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: int,
                 num_items_in_batch: Any = None, ignore_index: int = -100,
                 shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        state = self.head_state
        spec: HeadSpec = state.spec
        owner = spec.owner
        if not isinstance(logits, LazyLogits) or logits.materialized:
            if torch.compiler.is_compiling():  # the head returned real logits: a placeholder is not traceable
                warn_once_traced(("compiled head", spec.name), "%s: inside a torch.compile'd region the tiled loss "
                                 "runs untiled (the model materializes its T x vocab logits); compile the decoder "
                                 "layers instead of the whole model to keep the tiled loss", spec.name)
                set_traced(state, "fallback", COMPILED_HEAD)
            call = owner.calls[-1] if owner.calls else None
            if call is not None and call.materialized_by is not None:
                raise ValueError(
                    f"{owner.name}: the model applies {call.materialized_by} to its logits before computing "
                    "its loss; the tiled loss can fold only scaling, tanh softcapping and upcasts into the "
                    "loss, so this model's loss cannot be tiled exactly. Enable tiling with loss=False.")
            return _causal_lm_loss()(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels,
                                     **kwargs)
        if logits.shape[-1] != vocab_size:
            raise ValueError(f"{owner.name}: the head has {logits.shape[-1]} outputs but the loss is asked for a "
                             f"vocabulary of {vocab_size}; make config.vocab_size match the output layer")
        if shift_labels is None:
            if not isinstance(labels, torch.Tensor):
                raise ValueError(f"{owner.name}: labels must be a tensor of token ids, got {type(labels).__name__}")
            labels = F.pad(labels, (0, 1), value=ignore_index)  # ForCausalLMLoss: tokens < n predict n
            shift_labels = labels[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        if shift_labels.dtype.is_floating_point or shift_labels.dtype == torch.bool:
            raise ValueError(f"{owner.name}: labels must be integer token ids (torch.long), got {shift_labels.dtype}")
        if shift_labels.numel() != logits.shape[:-1].numel():
            raise ValueError(f"{owner.name}: labels of shape {tuple(shift_labels.shape)} do not match the "
                             f"{tuple(logits.shape[:-1])} tokens the model computes logits for; pass labels "
                             "shaped like input_ids (and logits_to_keep=0 when training)")
        options = spec.options
        loss_spec = CrossEntropySpec(ignore_index=ignore_index, transform=logits.transform,
                                     scratch_mib=options.scratch_mib, mode=options.mode)
        hidden = logits.hidden
        try:
            loss = linear_cross_entropy(state.choice.strategy(owner.head), owner.head, spec.params, hidden,
                                        shift_labels.reshape(hidden.shape[:-1]), loss_spec, num_items_in_batch,
                                        options.grad_accum_dtype, spec.name)
        finally:
            if owner.calls:
                owner.calls[-1].release_head()
        if loss.grad_fn is not None:  # lazy_logits' [Note: the hidden states after the loss's backward]
            loss.grad_fn.register_prehook(_ReleaseHidden(logits))
        return loss


class _ReleaseHidden:
    """A pre-hook on the tiled loss's node: the placeholder lets go of the hidden states as the loss's backward
    begins, unless its logits were read (their own backward may need them; and they hold far more). Held weakly: the
    hook must not keep the placeholder, or its hidden states, alive."""

    __slots__ = ("logits",)

    def __init__(self, logits: LazyLogits) -> None:
        self.logits = weakref.ref(logits)

    def __call__(self, grad_outputs: Any) -> None:
        logits = self.logits()
        if logits is not None and not logits.materialized:
            logits.recipe.release()


def patch_owner(model: nn.Module, owner: LossOwner, head_state: Any) -> None:
    """Install the model-side patches (``loss_function`` and the call hooks) for ``owner``, replacing
    earlier ones (their saved original stays the original)."""
    unpatch_owner(model)
    owner.had_loss_function = "_loss_function" in model.__dict__
    owner.saved_loss_function = model.__dict__.get("_loss_function")
    model.loss_function = TiledCausalLMLoss(head_state)
    owner.handles = [model.register_forward_pre_hook(_CallStart(owner), with_kwargs=True),
                     model.register_forward_hook(_CallEnd(owner), always_call=True)]
    model.__dict__[OWNER_ATTR] = owner


def unpatch_owner(model: nn.Module) -> None:
    owner: Optional[LossOwner] = model.__dict__.pop(OWNER_ATTR, None)
    if owner is None:
        return
    for handle in owner.handles:
        handle.remove()
    if owner.had_loss_function:
        model.loss_function = owner.saved_loss_function
    else:
        model.__dict__.pop("_loss_function", None)

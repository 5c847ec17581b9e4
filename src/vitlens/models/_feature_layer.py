"""One feature layer of a timm classifier whose attention vitlens does not propagate (Twins, CoaT, CrossViT, NesT,
VOLO, TNT, EfficientViT-MSRA): the class-activation methods' layer, AHA's ``feature_info`` maps where they can be
read, a trial forward for input sizes other than the model's own. Package-internal: the family adapters
(:mod:`.timm_twins`, :mod:`.timm_coat`, :mod:`.timm_crossvit`, :mod:`.timm_nest`, :mod:`.timm_volo`, :mod:`.timm_tnt`,
:mod:`.timm_efficientvit`) say which layer and why the attention methods do not apply.

The layer is recorded as :class:`~vitlens.models.base.Recording` block 0 (``u``), in token layout ``(B, T, C)``
(``num_prefix_tokens`` first, then the grid row-major), as a CNN's final feature map is (:mod:`.timm_cnn`): a leaf
that replaces the tensor in the forward, so the backward stops there. A family reads it as the first input of a
module (a forward pre-hook) or as a module's output (a forward hook, where the tensor every path to the prediction
passes through is a module's output); in token layout, or as a ``(B, C, h, w)`` / ``(B, h, w, C)`` map.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from .base import Adapter, BlockRecord, Recording, int_pair, switched
from .capabilities import (ATTENTION, BLOCK_IO, CLASS_ATTENTION, CLASS_LOGITS, FEATURE_MAPS, FEATURES, LINEAR_HEAD,
                           LRP_LINEARS, LRP_VARIANT_LINEARS, PIXEL_LOGITS, STAGES, TOKEN_SEQUENCE, TOKENS, WINDOWS)
from .feature_maps import feature_maps_reason

__all__ = ["FeatureLayerAdapter"]

#: the capabilities the attention methods need; a family gives one reason for all of them
ATTENTION_CAPS = (ATTENTION, BLOCK_IO, TOKEN_SEQUENCE, LRP_LINEARS, LRP_VARIANT_LINEARS, LINEAR_HEAD, STAGES, WINDOWS,
                  CLASS_ATTENTION)
_LAYOUTS = ("tokens", "nchw", "nhwc")


class FeatureLayerAdapter(Adapter):
    """Class logits and one feature layer of a timm classifier; ``feature_maps`` where timm's ``feature_info``
    modules output ``(B, C, h, w)`` maps at the model's size. Subclasses set :attr:`layout`, :attr:`on_output` and
    implement :meth:`feature_module`, :meth:`take` and :meth:`put` (and :meth:`token_grid` in token layout)."""

    #: the wrapped model; typed ``Any`` because the family's submodules are reached by attribute
    model: Any

    capabilities = frozenset({CLASS_LOGITS, FEATURES})
    #: how the feature tensor is laid out: ``"tokens"`` ``(B, T, C)``, ``"nchw"`` or ``"nhwc"`` maps
    layout = "tokens"
    #: ``True``: the feature is (part of) the output of :meth:`feature_module`; ``False``: of its positional inputs
    on_output = False

    def __init__(self, model: nn.Module, why: str, tokens_why: str, size: tuple[int, int]) -> None:
        super().__init__(model)
        m = self.model
        if self.layout not in _LAYOUTS:
            raise TypeError(f"layout {self.layout!r} is not one of {_LAYOUTS}")
        if isinstance(getattr(m, "global_pool", None), str) and m.global_pool == "":
            raise UnsupportedModelError("global_pool='': the model outputs its features, not class logits")
        self.num_classes = int(m.num_classes)
        self.in_chans = int(getattr(m, "in_chans", 3))
        self.size = int_pair(size)
        self.default_size = self.size
        self.capability_notes = {c: why for c in ATTENTION_CAPS}
        self.capability_notes.update({
            TOKENS: tokens_why, PIXEL_LOGITS: "the model outputs class logits (B, K), not per-pixel logits"})
        self._maps_reason = feature_maps_reason(m, self.size)
        if self._maps_reason is None:
            self.capabilities = self.capabilities | {FEATURE_MAPS}
        #: input size → the refusal of that size (``None``: the model runs it), from one trial forward each
        self._verdicts: dict[tuple[int, int], str | None] = {}
        #: input size → the feature layer's grid, seen in a forward (map layouts)
        self._grids: dict[tuple[int, int], tuple[int, int]] = {}
        self._hw: tuple[int, int] | None = None

    # -- what a family says ------------------------------------------------------------------------------------
    def feature_module(self) -> nn.Module:
        """The module whose first input (or output, :attr:`on_output`) carries the feature layer."""
        raise NotImplementedError

    def take(self, value: Any) -> Tensor:
        """The feature tensor in ``value`` (the module's positional inputs, or its output)."""
        return value[0] if isinstance(value, tuple) else value

    def put(self, value: Any, t: Tensor) -> Any:
        """``value`` with the feature tensor replaced by ``t``."""
        return (t, *value[1:]) if isinstance(value, tuple) else t

    def token_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """In token layout: the grid of the feature tokens for an input of ``input_hw``."""
        raise NotImplementedError

    def maps_note(self) -> str:
        """Why timm's ``feature_info`` maps cannot be read, after the probe's finding (a family may add to it)."""
        return self._maps_reason or "its timm feature_info modules output no (B, C, h, w) maps"

    # -- the adapter interface ---------------------------------------------------------------------------------
    def lacking(self, capability: str) -> str:
        if capability == FEATURE_MAPS:
            return self.maps_note()
        return super().lacking(capability)

    def feature_layers(self) -> list[nn.Module]:
        """One feature layer (``layer`` 0 or −1), the family's (module docstring)."""
        return [self.feature_module()]

    def layernorms(self) -> list[nn.Module]:
        return []

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The feature layer's grid (the model has no one patch grid the methods could share)."""
        return self.feature_grid(input_hw)

    def feature_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        hw = int_pair(input_hw)
        if self.layout == "tokens":
            return self.token_grid(hw)
        if hw not in self._grids:  # not seen in a forward yet: one trial forward records it
            p = next(iter(self.model.parameters()))
            self._trial(torch.zeros(1, int(self.in_chans or 3), *hw, dtype=p.dtype, device=p.device))
        if hw not in self._grids:
            raise InputError(self._verdicts.get(hw) or f"the feature layer of {type(self.model).__name__} was not "
                                                       f"reached for a {hw[0]}x{hw[1]} input")
        return self._grids[hw]

    def check_input(self, x: Tensor) -> None:
        super().check_input(x)
        hw = int_pair(x.shape[-2:])
        if hw == self.size:
            return
        if hw not in self._verdicts:
            self._trial(x[:1].detach())
        refusal = self._verdicts[hw]
        if refusal is not None:
            raise InputError(refusal)

    def _forward(self, x: Tensor) -> Tensor:
        self._hw = int_pair(x.shape[-2:])
        return super()._forward(x)

    # -- internals ---------------------------------------------------------------------------------------------
    def _trial(self, x: Tensor) -> None:
        """One forward of ``x`` in eval mode without gradients (batch-norm statistics untouched): records the
        feature grid and whether the model runs this size, in the model's own words when it does not."""
        hw = int_pair(x.shape[-2:])
        refusal = None
        handle = self._register(lambda t: self._grids.__setitem__(hw, self._map_grid(t)), replace=False)
        try:
            with torch.no_grad(), switched(list(self.model.modules()), "training", False):
                self.model(x)
        except (RuntimeError, ValueError, AssertionError, IndexError) as e:
            refusal = (f"{type(self.model).__name__} cannot run a {hw[0]}x{hw[1]} input (the model refuses it: "
                       f"{str(e).splitlines()[0][:200]})")
        finally:
            handle.remove()
        self._verdicts[hw] = refusal

    def _map_grid(self, t: Tensor) -> tuple[int, int]:
        if self.layout == "nchw":
            return int(t.shape[2]), int(t.shape[3])
        if self.layout == "nhwc":
            return int(t.shape[1]), int(t.shape[2])
        return (0, 0)  # token layout: the family's token_grid says

    def _to_tokens(self, t: Tensor) -> Tensor:
        if self.layout == "nchw":
            return t.flatten(2).transpose(1, 2)
        if self.layout == "nhwc":
            return t.flatten(1, 2)
        return t

    def _from_tokens(self, u: Tensor, like: Tensor) -> Tensor:
        if self.layout == "nchw":
            return u.transpose(1, 2).reshape(like.shape)
        return u.reshape(like.shape)

    def _register(self, fn: Any, replace: bool) -> Any:
        """A hook on :meth:`feature_module` that calls ``fn(feature)``; with ``replace`` the feature is replaced by
        what ``fn`` returns."""
        def on(value: Any) -> Any:
            got = fn(self.take(value))
            return self.put(value, got) if replace else None

        if self.on_output:
            return self.feature_module().register_forward_hook(lambda mod, args, out: on(out))
        return self.feature_module().register_forward_pre_hook(lambda mod, args: on(args))

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        rec.blocks.append(BlockRecord())

        def leaf(t: Tensor) -> Tensor:
            if self._hw is not None and self.layout != "tokens":
                self._grids[self._hw] = self._map_grid(t)
            # a leaf in token layout: the backward stops here
            u = self._to_tokens(t.detach()).requires_grad_(True)
            rec.blocks[0].u = u
            return self._from_tokens(u, t)

        hooks.append(self._register(leaf, replace=True))

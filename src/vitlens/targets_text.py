"""Text targets: explain a vision–language model's image–text score.

The model is a :class:`vitlens.VisionLanguageModel` (CLIP, SigLIP, SigLIP2, open_clip, ``shapes-clip``, an image
tower with text embeddings): its output, the "logits" a target receives, are the image embeddings ``(B, D)``. A text
target turns them into the model's own score

    ``y = scale · cos(e(x), e(t)) + bias``     (CLIP: ``scale = exp(logit_scale)``; SigLIP: with its ``logit_bias``)

>>> t = TextPrompt("a cat")                        # the same prompt for every image
>>> t = TextPrompt(["a cat", "a dog"])             # one prompt per image (a batch of 2)
>>> t = TextContrast("a cat", "a dog", gamma=1.0)  # y(a cat) - 1.0 · y(a dog)
>>> t = TextProbability("a cat", among=["a cat", "a dog", "a car"])  # softmax over the three prompts' scores
>>> t = TextEmbedding(text_emb)                    # precomputed text embeddings (D,) or (B, D)

Texts are tokenised with the model's own tokenizer; the text embeddings are computed once per distinct prompt
(without gradients) when the target is bound to the model, at the start of an explanation, and reused for every
forward of the explanation (perturbation methods call the model many times). ``classes`` of a resolved text target
is the index of each image's prompt in :attr:`TextPrompt.prompts`.

:class:`TextProbability` is the zero-shot probability of the prompt: always in ``(0, 1)``, so a signed map's most
important region is its most positive one (a raw score can be negative, and a negative score's map is negative where
it matters most). For metrics and ``vitlens bench`` over a prompt set, use :class:`vitlens.ZeroShotClassifier`
(prompts as classes).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import TargetError
from .targets import Target

__all__ = ["TEXT_KINDS", "TextPrompt", "TextContrast", "TextProbability", "TextEmbedding"]

Texts = Union[str, Sequence[str]]


def _texts(texts: Texts, what: str) -> list[str]:
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, Sequence) or not texts or not all(isinstance(t, str) for t in texts):
        raise TargetError(f"{what} takes a prompt (str) or a non-empty list of prompts, one per image; got "
                          f"{type(texts).__name__}")
    return list(texts)


def _vlm_of(model: Any, what: str) -> Any:
    """The vision–language model behind ``model`` (an adapter or a module), with ``encode_text``/``similarity``."""
    m = getattr(model, "model", model)
    if callable(getattr(m, "encode_text", None)) and callable(getattr(m, "similarity", None)):
        return m
    if isinstance(model, torch.nn.Module):  # a module, not its adapter: its adapter wraps a plain CLIPModel
        from .models import get_adapter

        return _vlm_of(get_adapter(model), what)
    if hasattr(m, "prompts") and hasattr(m, "vlm"):
        raise TargetError(f"{what}: a ZeroShotClassifier's outputs are prompt scores; target a prompt by its index "
                          "(e.g. target=0), or explain its .vlm with a text target")
    raise TargetError(f"{what} needs a vision–language model (vitlens.VisionLanguageModel(model, tokenizer)); "
                      f"{type(m).__name__} has no text encoder")


def _per_image(emb: Tensor, index: Tensor, b: int) -> Tensor:
    return emb[index.to(emb.device)] if index.numel() == b else emb[index.to(emb.device)].expand(b, -1)


class TextPrompt(Target):
    """The image–text score of a prompt: ``scale · cos(e(x), e(text)) + bias`` (the model's own logit).

    Args:
        texts: one prompt for every image, or a list with one prompt per image.
    """

    def __init__(self, texts: Texts) -> None:
        self._texts = _texts(texts, type(self).__name__)
        self.prompts: list[str] = list(dict.fromkeys(self._texts))
        self.classes = None
        self._emb: Tensor | None = None  # (P, D) text embeddings of ``prompts``, once bound
        self.scale: float = 1.0
        self.bias: float | None = None
        self.bound = False

    # -- binding: the text side, once per explanation -----------------------------------------------------------------
    def bind(self, model: Any) -> "TextPrompt":
        vlm = _vlm_of(model, type(self).__name__)
        t = copy.copy(self)
        t._emb = vlm.encode_text(self.prompts)
        t.scale, t.bias, t.bound = float(vlm.scale), vlm.bias, True
        return t

    def _embeddings(self) -> Tensor:
        if self._emb is None:
            raise TargetError(f"{type(self).__name__} is not bound to a model: vitlens.explain binds it (or call "
                              "target.bind(model) first)")
        return self._emb

    def check_logits(self, logits: Tensor) -> None:
        emb = self._embeddings()
        if logits.ndim != 2 or logits.shape[1] != emb.shape[1]:
            raise TargetError(f"{type(self).__name__} scores image embeddings (B, {emb.shape[1]}); got model output "
                              f"of shape {tuple(logits.shape)}")

    def _index(self, texts: list[str], b: int) -> Tensor:
        if len(texts) not in (1, b):
            raise TargetError(f"{type(self).__name__}: {len(texts)} prompts given for a batch of {b} images (give "
                              "one prompt for all, or one per image)")
        idx = torch.tensor([self.prompts.index(t) for t in texts], dtype=torch.long)
        return idx.expand(b).clone() if idx.numel() == 1 else idx

    def resolve(self, logits: Tensor) -> "TextPrompt":
        self.check_logits(logits)
        t = copy.copy(self)
        t.classes = self._index(self._texts, logits.shape[0]).to(logits.device)
        return t

    def _logit(self, cosine: Tensor) -> Tensor:
        """The model's score from a cosine: ``scale · cos (+ bias)``."""
        s = self.scale * cosine
        return s if self.bias is None else s + self.bias

    def _text_unit(self, logits: Tensor) -> Tensor:
        """The bound prompts' unit-length text embeddings ``(P, D)``, on the logits' device and dtype."""
        return F.normalize(self._embeddings().to(device=logits.device, dtype=logits.dtype), dim=-1)

    def _scores(self, logits: Tensor, classes: Tensor) -> Tensor:
        text = _per_image(self._text_unit(logits), classes, logits.shape[0])
        return self._logit((F.normalize(logits, dim=-1) * text).sum(-1))

    def score(self, logits: Tensor) -> Tensor:
        return self._scores(logits, self.resolved_classes())

    def select(self, index: Tensor | slice) -> "TextPrompt":
        t = copy.copy(self)
        t.classes = self.resolved_classes()[index]
        return t

    def chunk(self, index: slice, batch: int) -> "TextPrompt":
        if (index.start == 0 and index.stop == batch) or len(self._texts) == 1:
            return self
        if len(self._texts) != batch:
            raise TargetError(f"{len(self._texts)} prompts given for a batch of {batch} images")
        t = copy.copy(self)
        t._texts = self._texts[index]
        return t

    def describe(self) -> dict:
        out: dict[str, Any] = {"kind": type(self).__name__, "prompts": self.prompts}
        if len(self._texts) > 1:
            out["texts"] = self._texts
        if self.bound:
            out["scale"], out["bias"] = self.scale, self.bias
        return out


class TextContrast(TextPrompt):
    """Contrast between two prompts: ``y(texts) − gamma · y(versus)`` (like :class:`vitlens.Contrast` for classes).

    ``texts`` and ``versus`` are each one prompt for all images or one per image.
    """

    def __init__(self, texts: Texts, versus: Texts, gamma: float = 1.0) -> None:
        super().__init__(texts)
        self._versus = _texts(versus, "TextContrast(versus)")
        self.prompts = list(dict.fromkeys(self._texts + self._versus))
        self.gamma = float(gamma)
        self.versus: Tensor | None = None

    def resolve(self, logits: Tensor) -> "TextContrast":
        t = super().resolve(logits)
        assert isinstance(t, TextContrast)
        versus = self._index(self._versus, logits.shape[0]).to(logits.device)
        classes = t.resolved_classes()
        same = versus == classes
        if bool(same.any()):
            i = int(same.nonzero()[0, 0])
            raise TargetError(f"TextContrast: image {i} contrasts {self.prompts[int(classes[i])]!r} with itself")
        t.versus = versus
        return t

    def _resolved_versus(self) -> Tensor:
        if self.versus is None:
            raise TargetError("TextContrast is not resolved: call it on the model's output first")
        return self.versus

    def score(self, logits: Tensor) -> Tensor:
        return self._scores(logits, self.resolved_classes()) - self.gamma * self._scores(logits,
                                                                                          self._resolved_versus())

    def select(self, index: Tensor | slice) -> "TextContrast":
        t = super().select(index)
        assert isinstance(t, TextContrast)
        t.versus = self._resolved_versus()[index]
        return t

    def chunk(self, index: slice, batch: int) -> "TextContrast":
        t = super().chunk(index, batch)
        assert isinstance(t, TextContrast)
        if t is self or len(self._versus) == 1 or (index.start == 0 and index.stop == batch):
            return t
        t = copy.copy(t)
        if len(self._versus) != batch:
            raise TargetError(f"{len(self._versus)} versus prompts given for a batch of {batch} images")
        t._versus = self._versus[index]
        return t

    def describe(self) -> dict:
        out = super().describe()
        out["versus"] = self._versus if len(self._versus) > 1 else self._versus[0]
        out["gamma"] = self.gamma
        return out


class TextProbability(TextPrompt):
    """The zero-shot probability of a prompt among a set of prompts: ``softmax_p(y(among_p))`` at the image's prompt,
    where ``y`` is the model's own image–text score (what :class:`TextPrompt` explains) of every prompt of ``among``.

    The same number as :class:`vitlens.ZeroShotClassifier` over ``among`` with :class:`vitlens.ClassProbability`, but
    on the vision–language model itself, with the prompt named in descriptions and figures. ``classes`` of a resolved
    target (and ``prompts``) index ``among``.

    Args:
        texts: the explained prompt for every image, or one per image; each must be one of ``among`` (a
            :class:`vitlens.TargetError` otherwise: it is not added silently, which would change every probability).
        among: the prompts the probability is taken over, at least two, distinct.
    """

    def __init__(self, texts: Texts, among: Sequence[str]) -> None:
        super().__init__(texts)
        if isinstance(among, str) or not isinstance(among, Sequence) or \
                not all(isinstance(t, str) for t in among):
            raise TargetError("TextProbability(among) takes a list of prompts, the set the probability is taken "
                              f"over; got {type(among).__name__}")
        self.among = list(among)
        if len(self.among) < 2:
            raise TargetError(f"TextProbability needs at least 2 prompts in among (a probability over one prompt is "
                              f"always 1); got {len(self.among)}")
        twice = [t for t in dict.fromkeys(self.among) if self.among.count(t) > 1]
        if twice:
            raise TargetError(f"TextProbability: among must hold distinct prompts; {twice[0]!r} is given "
                              f"{self.among.count(twice[0])} times")
        missing = [t for t in self.prompts if t not in self.among]
        if missing:
            raise TargetError(f"TextProbability: the prompt {missing[0]!r} is not one of among {self.among}; add it "
                              "there (the probability is over among)")
        self.prompts = list(self.among)  # every prompt of among is scored; classes index it

    def score(self, logits: Tensor) -> Tensor:
        scores = self._logit(F.normalize(logits, dim=-1) @ self._text_unit(logits).T)  # (B, P): the model's own
        return scores.softmax(dim=-1).gather(1, self.resolved_classes().to(logits.device)[:, None])[:, 0]

    def describe(self) -> dict:
        out = super().describe()
        out["texts"] = self._texts if len(self._texts) > 1 else self._texts[0]
        out["among"] = self.among
        return out


class TextEmbedding(TextPrompt):
    """The image–text score against precomputed text embeddings: ``scale · cos(e(x), t) + bias``.

    Args:
        embeddings: ``(D,)`` for every image or ``(B, D)`` one per image.
        scale, bias: the score's scale and bias; default: the model's (a :class:`vitlens.VisionLanguageModel`),
            else ``1`` and none (the plain cosine) for a model whose output is an embedding (e.g. a timm image tower
            with ``num_classes=0``).
    """

    #: the model's output (an image tower without a classifier, ``num_classes=0``) is what this target scores
    scores_embeddings = True

    def __init__(self, embeddings: Tensor, scale: float | None = None, bias: float | None = None) -> None:
        if not isinstance(embeddings, Tensor) or embeddings.ndim not in (1, 2) or not embeddings.is_floating_point() \
                or embeddings.numel() == 0:
            raise TargetError("TextEmbedding takes a float tensor (D,) for every image or (B, D) one per image")
        if not bool(torch.isfinite(embeddings).all()):
            raise TargetError("TextEmbedding: the embeddings contain NaN or inf")
        from .models.vlm import ordinary

        emb = ordinary(embeddings)
        emb = emb[None] if emb.ndim == 1 else emb
        super().__init__([f"<embedding {i}>" for i in range(emb.shape[0])])
        self._given = emb
        self._given_scale = None if scale is None else float(scale)
        self._given_bias = None if bias is None else float(bias)

    def bind(self, model: Any) -> "TextEmbedding":
        t = copy.copy(self)
        t._emb = self._given
        m = getattr(model, "model", model)
        vlm = m if callable(getattr(m, "similarity", None)) else None
        t.scale = self._given_scale if self._given_scale is not None else float(vlm.scale) if vlm is not None else 1.0
        t.bias = self._given_bias if self._given_bias is not None else (vlm.bias if vlm is not None else None)
        t.bound = True
        return t

    def chunk(self, index: slice, batch: int) -> "TextEmbedding":
        t = super().chunk(index, batch)
        if t is self:
            return t
        assert isinstance(t, TextEmbedding)
        t = copy.copy(t)
        t._given = self._given[index]
        t.prompts = t._texts = [f"<embedding {i}>" for i in range(t._given.shape[0])]
        if t._emb is not None:
            t._emb = t._given
        return t

    def describe(self) -> dict:
        out: dict[str, Any] = {"kind": "TextEmbedding", "embeddings": list(self._given.shape)}
        if self.bound:
            out["scale"], out["bias"] = self.scale, self.bias
        return out


#: the ``kind`` a text target's ``describe()`` gives (figures and the command line tell text targets by it)
TEXT_KINDS = tuple(c.__name__ for c in (TextPrompt, TextContrast, TextProbability, TextEmbedding))

"""Architecture of the bundled ``shapes-clip`` model (registered in :data:`vitlens.models.zoo.BUNDLED`): a small
CLIP-style vision–language model trained by vitlens on the multi-object scenes (the proving ground's VLM).

``shapes-clip`` exposes the interface of ``transformers.CLIPModel`` that the text targets use:

* ``get_image_features(pixel_values)``: ``(B, 3, H, W)`` normalised images → ``(B, D)`` image embeddings (not
  normalised); ``pixel_values`` are RGB in ``[0, 1]`` normalised as ``(x - 0.5) / 0.25`` (``pretrained_cfg``);
* ``get_text_features(input_ids, attention_mask=None)``: ``(P, L)`` token ids → ``(P, D)`` text embeddings;
* ``logit_scale`` (a parameter; the image–text score is ``logit_scale.exp() * cosine``) and ``logit_bias = None``;
* ``vision_model``: a real timm ``VisionTransformer`` (conv stem, 8-px tokens, CLS readout) whose classifier head is
  the projection into the joint space (so ``vision_model(x) == get_image_features(x)``), read by vitlens's timm
  ViT adapter like ``shapes-vit``; ``text_model``: :class:`TextTransformer`; ``tokenizer``: :class:`WordTokenizer`.

The tokenizer is word-level over :data:`VOCABULARY` (the words of the training captions): text is lower-cased and
split into words and punctuation. A word outside the vocabulary maps to ``[UNK]`` with a :class:`UnknownWordWarning`
naming it (``unknown="error"`` raises :class:`vitlens.errors.InputError` instead): the model never saw such a word,
so its score says nothing about it.

Example::

    import vitlens
    model = vitlens.load_model("shapes-clip")
    tok = model.tokenizer(["a ring", "a triangle"])
    text = model.get_text_features(**tok)                               # (2, D)
    image = model.get_image_features((images - 0.5) / 0.25)              # (B, D), images in [0, 1]
    scores = model.logit_scale.exp() * F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).T
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from vitlens.data.scenes import CLASS_NAMES
from vitlens.errors import InputError

__all__ = [
    "CAPTION_WORDS",
    "EMBED_DIM",
    "MAX_TEXT_LENGTH",
    "SPECIAL_TOKENS",
    "VOCABULARY",
    "ShapesCLIP",
    "ShapesCLIPOutput",
    "TextTransformer",
    "UnknownWordWarning",
    "WordTokenizer",
]

#: Words of the training captions other than the class names (templates, positions, punctuation).
CAPTION_WORDS: tuple[str, ...] = (
    "a", "and", ",", "picture", "photo", "scene", "of", "with", "on", "the", "at", "in", "left", "right", "top",
    "bottom", "centre",
)
#: Special tokens: padding, unknown word, start and end of text (ids 0–3).
SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")
#: The tokenizer's vocabulary, id = index.
VOCABULARY: tuple[str, ...] = SPECIAL_TOKENS + tuple(CLASS_NAMES) + CAPTION_WORDS
#: Most tokens a text may have (``[BOS]`` and ``[EOS]`` included).
MAX_TEXT_LENGTH: int = 32
#: Dimension of the joint image–text embedding space.
EMBED_DIM: int = 128

_WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


class UnknownWordWarning(UserWarning):
    """A prompt holds a word outside the tokenizer's vocabulary (it is mapped to ``[UNK]``)."""


class WordTokenizer:
    """Word-level tokenizer of ``shapes-clip``: lower-case, split into words (``[a-z0-9]+``) and single punctuation
    marks, each mapped to its id in ``vocabulary``; ``[BOS]`` before and ``[EOS]`` after every text.

    Args:
        vocabulary: the tokens, id = index; must start with :data:`SPECIAL_TOKENS`.
        max_length: most tokens per text (longer texts are an :class:`~vitlens.errors.InputError`).
        unknown: ``"warn"`` (map unknown words to ``[UNK]`` with an :class:`UnknownWordWarning`) or ``"error"``.
    """

    def __init__(self, vocabulary: Sequence[str] = VOCABULARY, max_length: int = MAX_TEXT_LENGTH,
                 unknown: str = "warn") -> None:
        if tuple(vocabulary[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            raise InputError(f"the vocabulary must start with {', '.join(SPECIAL_TOKENS)}")
        if unknown not in ("warn", "error"):
            raise InputError(f"unknown must be 'warn' or 'error', got {unknown!r}")
        self.vocabulary = tuple(vocabulary)
        self.ids = {w: i for i, w in enumerate(self.vocabulary)}
        self.max_length, self.unknown = int(max_length), unknown
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = range(4)

    def __len__(self) -> int:
        return len(self.vocabulary)

    @staticmethod
    def words(text: str) -> list[str]:
        """The words and punctuation marks of ``text``, lower-cased."""
        return _WORD.findall(text.lower())

    def encode(self, text: str) -> list[int]:
        """Token ids of one text, ``[BOS] … [EOS]``."""
        if not isinstance(text, str):
            raise InputError(f"a prompt must be a string, got {type(text).__name__}")
        words = self.words(text)
        unknown = [w for w in words if w not in self.ids]
        if unknown:
            known = ", ".join(w for w in self.vocabulary[len(SPECIAL_TOKENS):] if w.isalpha())
            msg = (f"shapes-clip does not know the word(s) {', '.join(repr(w) for w in unknown)} in {text!r} "
                   f"(its vocabulary: {known})")
            if self.unknown == "error":
                raise InputError(msg)
            warnings.warn(msg + "; they are read as [UNK]", UnknownWordWarning, stacklevel=3)
        ids = [self.bos_id, *(self.ids.get(w, self.unk_id) for w in words), self.eos_id]
        if len(ids) > self.max_length:
            raise InputError(f"prompt {text!r} has {len(ids)} tokens, more than shapes-clip's {self.max_length}")
        return ids

    def __call__(self, texts: str | Sequence[str], padding: bool = True,
                 return_tensors: str | None = "pt") -> dict[str, torch.Tensor]:
        """Tokenise ``texts`` (one string or a list): ``{"input_ids": (P, L), "attention_mask": (P, L)}`` LongTensors,
        padded with ``[PAD]`` (id 0, mask 0) to the longest text. ``padding``/``return_tensors`` exist for
        compatibility with HuggingFace tokenizers' call; only padded PyTorch tensors are returned."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Sequence) or len(texts) == 0:
            raise InputError("give at least one prompt (a string or a list of strings)")
        if return_tensors not in (None, "pt"):
            raise InputError(f"the shapes-clip tokenizer returns PyTorch tensors only, not {return_tensors!r}")
        rows = [self.encode(t) for t in texts]
        length = max(len(r) for r in rows)
        ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        """The text of one row of token ids (words joined by spaces, no space before punctuation)."""
        specials = set(range(len(SPECIAL_TOKENS))) - {self.unk_id}
        words = [self.vocabulary[int(i)] for i in ids if not (skip_special_tokens and int(i) in specials)]
        return re.sub(r" ([^\sa-z0-9\[])", r"\1", " ".join(words))

    def batch_decode(self, ids: torch.Tensor, skip_special_tokens: bool = True) -> list[str]:
        """:meth:`decode` of every row of ``(P, L)`` ids."""
        return [self.decode(row, skip_special_tokens) for row in ids]


class TextTransformer(torch.nn.Module):
    """The text encoder: token + learned position embeddings, ``depth`` pre-norm transformer blocks (bidirectional
    attention over the non-padding tokens), a final LayerNorm, the ``[EOS]`` token's features projected to
    ``embed_dim`` (as CLIP reads its text at the end-of-text token).

    Input ``input_ids (P, L)`` and ``attention_mask (P, L)`` (1 = token, 0 = padding; ``None``: all tokens); output
    ``(P, embed_dim)``.
    """

    def __init__(self, vocab_size: int = len(VOCABULARY), width: int = 128, depth: int = 3, heads: int = 4,
                 max_length: int = MAX_TEXT_LENGTH, embed_dim: int = EMBED_DIM) -> None:
        super().__init__()
        self.token_embedding = torch.nn.Embedding(vocab_size, width)
        self.position_embedding = torch.nn.Parameter(torch.zeros(max_length, width))
        torch.nn.init.normal_(self.position_embedding, std=0.02)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=True)
            for _ in range(depth)
        )
        self.final_norm = torch.nn.LayerNorm(width)
        self.projection = torch.nn.Linear(width, embed_dim, bias=False)
        self.max_length = max_length

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.ndim != 2:
            raise InputError(f"input_ids must be (P, L), got shape {tuple(input_ids.shape)}")
        p, length = input_ids.shape
        if length > self.max_length:
            raise InputError(f"input_ids has {length} tokens, more than the text encoder's {self.max_length}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise InputError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                             f"{tuple(input_ids.shape)}")
        keep = attention_mask.bool()
        x = self.token_embedding(input_ids) + self.position_embedding[:length]
        for blk in self.blocks:
            x = blk(x, src_key_padding_mask=~keep)
        x = self.final_norm(x)
        last = keep.long().sum(1).clamp(min=1) - 1  # the [EOS] token: the last non-padding position
        return self.projection(x[torch.arange(p), last])


@dataclass
class ShapesCLIPOutput:
    """What :meth:`ShapesCLIP.forward` returns (the fields of ``transformers``' ``CLIPOutput`` it needs)."""

    logits_per_image: torch.Tensor  # (B, P)
    logits_per_text: torch.Tensor  # (P, B)
    image_embeds: torch.Tensor  # (B, D), normalised
    text_embeds: torch.Tensor  # (P, D), normalised


class ShapesCLIP(torch.nn.Module):
    """A CLIP-style model: ``vision_model`` (timm ViT whose head projects into the joint space), ``text_model``
    (:class:`TextTransformer`), ``tokenizer`` (:class:`WordTokenizer`), ``logit_scale``; ``logit_bias`` is ``None``.

    Args:
        vision_model: a timm ``VisionTransformer`` with ``num_classes == embed_dim``.
        text_model: the text encoder, output ``(P, embed_dim)``.
        tokenizer: the tokenizer the text encoder was trained with.
        pretrained_cfg: the data config of the images (``mean``, ``std``, ``input_size``, ...).
    """

    def __init__(self, vision_model: torch.nn.Module, text_model: torch.nn.Module, tokenizer: WordTokenizer,
                 pretrained_cfg: dict[str, Any]) -> None:
        super().__init__()
        self.vision_model = vision_model
        self.text_model = text_model
        self.tokenizer = tokenizer
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.6592))  # log(1 / 0.07), CLIP's initial temperature
        self.logit_bias = None
        self.pretrained_cfg = dict(pretrained_cfg)
        self.default_cfg = self.pretrained_cfg

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` normalised images → ``(B, D)`` image embeddings (not normalised)."""
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 4 or pixel_values.shape[1] != 3:
            shape = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values)
            raise InputError(f"pixel_values must be a (B, 3, H, W) tensor, got {shape}")
        return self.vision_model(pixel_values)

    def get_text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(P, L)`` token ids (and mask) → ``(P, D)`` text embeddings (not normalised)."""
        return self.text_model(input_ids, attention_mask)

    def encode_text(self, texts: str | Sequence[str]) -> torch.Tensor:
        """Tokenise ``texts`` and return their ``(P, D)`` text embeddings (not normalised)."""
        return self.get_text_features(**self.tokenizer(texts))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> ShapesCLIPOutput:
        """Scores of every image against every text: ``logits_per_image (B, P) = logit_scale.exp() · cosine``."""
        img = F.normalize(self.get_image_features(pixel_values), dim=-1)
        txt = F.normalize(self.get_text_features(input_ids, attention_mask), dim=-1)
        logits = self.logit_scale.exp() * img @ txt.T
        return ShapesCLIPOutput(logits_per_image=logits, logits_per_text=logits.T, image_embeds=img, text_embeds=txt)

"""The adapter of a vision–language model (:class:`~vitlens.models.vlm.VisionLanguageModel` and
:class:`~vitlens.models.vlm.ZeroShotClassifier`): the explainers see the image tower.

The model's forward gives image embeddings ``(B, D)`` (or, zero-shot, the prompt scores ``(B, P)``); everything an
explainer reads inside the model — blocks, attention probabilities, the residual stream, LRP linears, the token grid,
feature layers — is the image tower's, read by the tower's own adapter (timm ViT or NaFlexVit, the transformers
CLIP / SigLIP / SigLIP2 vision transformer, open_clip's vision transformer, timm Eva). This adapter delegates those
members to it and runs the whole model (tower, projection, and for zero-shot the scores) as the forward, so a text
target explains exactly the score ``scale · cos(e(x), e(t)) + bias``. The output read from an intermediate block's
tokens (:meth:`VLMAdapter.stream_logits`, LeGrad) is the tower's own readout of them, then what the model applies
after the tower (:meth:`~vitlens.models.vlm.VisionLanguageModel.after_tower`), then for zero-shot the scores.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from torch import Tensor, nn

from ..errors import UnsupportedModelError
from .base import Adapter, LRPLinears, Recording
from .capabilities import CLASS_LOGITS, LINEAR_HEAD, PIXEL_LOGITS, STREAM_HEAD
from .hf_vlm import HFVisionTowerAdapter
from .openclip_tower import OpenClipTowerAdapter
from .timm_families import TimmEvaAdapter
from .timm_naflexvit import TimmNaFlexVitAdapter
from .timm_vit import TimmViTAdapter
from .vlm import VisionLanguageModel, ZeroShotClassifier, plain_vision_language

__all__ = ["VLMAdapter", "TOWER_ADAPTERS"]

#: the image-tower families this adapter reads, tried in order
TOWER_ADAPTERS: list[type[Adapter]] = [TimmNaFlexVitAdapter, TimmViTAdapter, TimmEvaAdapter, HFVisionTowerAdapter,
                                       OpenClipTowerAdapter]

_EMBEDDING = ("the model's output is an image embedding (B, D), not class logits: explain a text target "
              "(vitlens.TextPrompt, vitlens.TextEmbedding) or classify over prompts with vitlens.ZeroShotClassifier")


class VLMAdapter(Adapter):
    """A vision–language model, read through its image tower's adapter (see the module docstring)."""

    family = "vlm"
    model: Any

    @staticmethod
    def matches(model: nn.Module) -> bool:
        return isinstance(model, (VisionLanguageModel, ZeroShotClassifier)) or plain_vision_language(model)

    def __init__(self, model: Any) -> None:
        if plain_vision_language(model):  # a CLIPModel, shapes-clip, open_clip model passed as it is
            model = VisionLanguageModel(model)
        super().__init__(model)
        self.vlm: VisionLanguageModel = model.vlm if isinstance(model, ZeroShotClassifier) else model
        self.zero_shot = isinstance(model, ZeroShotClassifier)
        trunk = self.vlm.image_trunk()
        self.inner: Adapter | None = None
        reasons = []
        for cls in TOWER_ADAPTERS:
            if cls.matches(trunk):
                try:
                    self.inner = cls(trunk)
                except (UnsupportedModelError, AttributeError, TypeError, KeyError, ValueError) as e:
                    reasons.append(f"the {cls.family} adapter cannot read it: {str(e).splitlines()[0][:160]}")
                    continue
                break
        inner = self.inner
        self.family = f"vlm({inner.family})" if inner is not None else "vlm"
        if inner is None:
            self.fallback_reason = (f"no adapter reads the image tower {type(trunk).__name__}"
                                    + (f" ({'; '.join(reasons)})" if reasons else "")
                                    + f"; readable towers: {', '.join(c.family for c in TOWER_ADAPTERS)}")
            caps: frozenset[str] = frozenset()
            notes: dict[str, str] = {}
        else:
            caps = inner.capabilities - {CLASS_LOGITS, LINEAR_HEAD, PIXEL_LOGITS, STREAM_HEAD}
            notes = dict(inner.capability_notes)
            for key in ("num_prefix_tokens", "readout_tokens", "patch_size", "in_chans", "default_size", "any_size"):
                setattr(self, key, getattr(inner, key))
        notes[LINEAR_HEAD] = "the image embedding is projected (and normalised, scored against the text) after the tower"
        why = self._stream_head_missing()
        if why is None:
            caps = caps | {STREAM_HEAD}
        else:
            notes[STREAM_HEAD] = why
        if self.zero_shot:
            caps = caps | {CLASS_LOGITS}
            self.num_classes = int(model.num_classes)
        else:
            notes[CLASS_LOGITS] = _EMBEDDING
            self.num_classes = 0
        self.capabilities = caps
        self.capability_notes = notes

    def _stream_head_missing(self) -> str | None:
        """Why the model's output cannot be read from an intermediate block's tokens, or ``None`` if it can: the tower
        reads its own output from them (its ``stream_logits``) and vitlens knows what the model applies after it."""
        inner = self.inner
        if inner is None:
            return self.fallback_reason
        if STREAM_HEAD not in inner.capabilities:
            own = inner.capability_notes.get(STREAM_HEAD)
            return f"the image tower ({inner.family}) reads no intermediate block's tokens" + (f": {own}" if own else "")
        try:
            self.vlm.after_tower()
        except UnsupportedModelError as e:
            return str(e)
        return None

    def stream_logits(self, tokens: Tensor) -> Tensor:
        """The model's output from the image tower's residual stream ``tokens`` ``(B, T, D)`` after any block: the
        tower's own readout (``stream_logits``), then what the model applies after the tower (CLIP's projection) —
        the image embedding ``(B, D)`` as :meth:`VisionLanguageModel.forward` gives it; for a
        :class:`ZeroShotClassifier` the prompt scores ``(B, P)`` from it (LeGrad, :data:`STREAM_HEAD`)."""
        if STREAM_HEAD not in self.capabilities:
            raise UnsupportedModelError(f"{type(self.vlm.model).__name__}: {self.capability_notes[STREAM_HEAD]}")
        embedding = self.vlm.after_tower()(self._tower().stream_logits(tokens))
        return self.model.scores(embedding) if self.zero_shot else embedding

    def _tower(self) -> Adapter:
        if self.inner is None:
            raise UnsupportedModelError(f"{type(self.vlm.model).__name__}: {self.fallback_reason}")
        return self.inner

    # -- running: the whole model; structure: the tower's ------------------------------------------------------------
    def _forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        return self._tower().grid(input_hw)

    def feature_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        return self._tower().feature_grid(input_hw)

    def feature_prefix_tokens(self) -> int:
        return self._tower().feature_prefix_tokens()

    def check_input(self, x: Tensor) -> None:
        if self.inner is None:
            super().check_input(x)
        else:
            self.inner.check_input(x)

    def blocks(self) -> Sequence[nn.Module]:
        return self._tower().blocks()

    def lrp_linears(self) -> list[LRPLinears]:
        return self._tower().lrp_linears()

    def feature_layers(self) -> Sequence[nn.Module]:
        return self._tower().feature_layers()

    def layernorms(self) -> list[nn.Module]:
        return self._tower().layernorms()

    def classifier_modules(self) -> list[nn.Module]:
        """The image projection (CLIP's ``visual_projection``), else the tower's head."""
        proj = getattr(self.vlm.model, "visual_projection", None)
        if isinstance(proj, nn.Module):
            return [proj]
        return self._tower().classifier_modules()

    def stage_container(self) -> tuple[str, list[nn.Module]] | None:
        return None if self.inner is None else self.inner.stage_container()

    def data_config(self) -> Any:
        from .data_configs import model_data_config

        return model_data_config(self.model)

    def architecture(self) -> str:
        return f"{type(self.vlm.model).__name__}" + ("" if self.inner is None else f"/{self.inner.architecture()}")

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        self._tower()._install_capture(rec, hooks)

    def _new_recording(self) -> Any:
        return self._tower()._new_recording() if self.inner is not None else Recording()

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        with self._tower()._explicit_attention():
            yield

    def recomputes_attention(self) -> bool:
        return self.inner is not None and self.inner.recomputes_attention()

    @contextlib.contextmanager
    def readout_only(self, all_queries: bool = True) -> Iterator[bool]:
        if self.inner is None:
            yield False
            return
        with self.inner.readout_only(all_queries=all_queries) as active:
            yield active

    def _embedding_module(self) -> nn.Module:
        return self._tower()._embedding_module()

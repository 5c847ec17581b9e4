"""The forward and backward the staged GradSkip paths share (SegFormer/PVTv2, MViTv2, MaxViT): one capturing session,
the target resolved on its logits, and the gradient of the score with respect to every tensor the recording keeps in
the graph, all in at least float32 whatever the model's dtype (as on the plain path)."""
from __future__ import annotations

from typing import Any

from torch import Tensor

from ..models import Adapter
from ..models.base import Recording
from ..targets import Target
from ._gradskip_rules import wide
from .base import Explainer

__all__ = ["captured_gradients"]


def captured_gradients(method: Explainer, adapter: Adapter, x: Tensor, target: Target,
                       **session: Any) -> tuple[Recording, Tensor, Target, Tensor, dict[int, Tensor]]:
    """``(recording, logits, resolved target, score, {id(tensor): gradient})`` of one forward and one backward in
    ``adapter.session(capture=True, conservative=…, **session)``."""
    with adapter.session(capture=True, conservative=bool(method.options["conservative"]), **session) as rec:
        logits = adapter.forward(x)
        tgt = method.resolve_target(target, logits)
        y = tgt(logits)
        wanted = rec.graph_tensors()
        grads = {id(t): wide(g) for t, g in zip(wanted, method.gradients(y, wanted))}
    return rec, logits, tgt, wide(y), grads

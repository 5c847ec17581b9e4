"""The adapter interface: the one place that knows model families.

An adapter wraps a model and knows (1) its token layout (prefix tokens, readout tokens, token grid for an input size)
and (2) how to *capture*, during one forward pass, the tensors that relevance methods need, block by block:

- ``attn``  (B, heads, T, T_k): attention probabilities, part of the autograd graph (explicit attention);
- ``value`` (B, heads, T_k, d_head): the value vectors (detached);
- ``u``     (B, T, D): the block's residual input;
- ``h``     (B, T, D): the residual stream after the attention add, ``h = u + attention_branch(u)``;
- ``final`` (B, T, D): the residual stream after the last block (before the final norm).

A session opened with ``recompute=True`` on a family that offers it (:meth:`Adapter.recomputes_attention`) keeps the
model's fused attention and records, instead of ``attn``, what the probabilities can be recomputed from:
``query``/``key`` (B, heads, T, d_head) (detached, after everything that enters the logits ``q·kᵀ``), ``scale`` and
``out`` (B, T_q, heads·d_head), the attention output before the output projection, part of the autograd graph (its
gradient ``g`` gives ``∂y/∂A = g·vᵀ`` per head). ``Recording.recompute`` says which of the two was recorded.

Everything an adapter changes on the model (hooks, fused/eager attention switches, train/eval mode, parameter
``requires_grad``) is undone when the :meth:`Adapter.session` context exits, also when an exception is raised inside.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from torch import Tensor, nn

from ..errors import InputError, UnsupportedModelError
from ..preprocessing import int_pair  # re-exported: how sizes are passed around
from ._probabilities_backward import Sink
from .capabilities import CLASS_ATTENTION, CLASS_LOGITS, STAGES, WINDOWS
from .data_configs import model_data_config

__all__ = ["Adapter", "BlockRecord", "LRPLinears", "Recording", "recorded", "conservative_layernorm_hook", "int_pair",
           "logits_of", "linears_at", "switched", "normalisation_layers"]


@dataclass(frozen=True)
class LRPLinears:
    """The linear maps of one pre-norm block that LRP rules act on: ``qkv``, the query/key/value projection(s) (one
    fused map, or three separate ones in the order query, key, value), ``proj`` the attention's output projection,
    ``fc1``/``fc2`` the MLP's two maps. Which projection output is query, key and value is still checked
    numerically by the LRP methods."""

    qkv: tuple[nn.Linear, ...]
    proj: nn.Linear
    fc1: nn.Linear
    fc2: nn.Linear
    #: the variants of the plain block that the gradient × input LRP rules also cover (``None``: not there).
    #: ``q_norm``/``k_norm`` normalise queries/keys per head before the softmax; ``ctx_norm`` normalises the attention
    #: output before ``proj``; ``mlp_norm`` the MLP's hidden features before ``fc2``
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    ctx_norm: nn.Module | None = None
    mlp_norm: nn.Module | None = None
    #: a gated MLP ``fc2(act(gate) · value)``: ``gate`` is the gate's own map (``fc1`` is then the value map), or
    #: ``packed_gate`` says which half (``"first"``/``"last"``) of the one ``fc1`` output is the gate
    gate: nn.Linear | None = None
    packed_gate: str | None = None
    #: the MLP's activation module (applied to the gate in a gated MLP) and the module that reads its output (the
    #: gated product): where the variant rules hook; declared for every variant block
    act: nn.Module | None = None
    after_act: nn.Module | None = None

    @property
    def gated(self) -> bool:
        return self.gate is not None or self.packed_gate is not None

    @property
    def plain(self) -> bool:
        """No q/k norm, scale norm or gate: the plain ViT block every LRP method is written for."""
        return not self.gated and all(m is None for m in (self.q_norm, self.k_norm, self.ctx_norm, self.mlp_norm))


def linears_at(block: nn.Module, index: int, qkv: Sequence[Sequence[str]], proj: Sequence[str], fc1: Sequence[str],
               fc2: Sequence[str]) -> LRPLinears:
    """The :class:`LRPLinears` of ``block`` from dotted submodule paths: ``qkv`` lists layouts (each a sequence of
    paths: one fused map or three), ``proj``/``fc1``/``fc2`` candidate paths; the first layout/path that names
    ``nn.Linear`` modules wins (e.g. transformers 5.x names first, then 4.x). Raises :class:`UnsupportedModelError`
    naming the block and the paths it looked for."""

    def linear(path: str) -> nn.Linear | None:
        try:
            found = block.get_submodule(path)
        except AttributeError:
            return None
        return found if isinstance(found, nn.Linear) else None

    def first(role: str, paths: Sequence[str]) -> nn.Linear:
        for path in paths:
            found = linear(path)
            if found is not None:
                return found
        raise UnsupportedModelError(f"block {index} ({type(block).__name__}): no nn.Linear {role} at "
                                    f"{' or '.join(paths)}")

    for layout in qkv:
        maps = [linear(p) for p in layout]
        if all(m is not None for m in maps):
            got = tuple(m for m in maps if m is not None)
            return LRPLinears(qkv=got, proj=first("output projection", proj), fc1=first("MLP input map", fc1),
                              fc2=first("MLP output map", fc2))
    raise UnsupportedModelError(f"block {index} ({type(block).__name__}): no nn.Linear query/key/value projection(s) "
                                f"at {' or '.join('+'.join(layout) for layout in qkv)}")


@dataclass
class BlockRecord:
    """What was captured in one transformer block (see module docstring for shapes)."""

    u: Tensor | None = None
    h: Tensor | None = None
    attn: Tensor | None = None
    value: Tensor | None = None
    query: Tensor | None = None
    key: Tensor | None = None
    out: Tensor | None = None
    scale: float = 1.0
    #: blocks whose attention and MLP both read the block input (timm ``ParallelScalingBlock``): ``h`` is then the
    #: block output ``u + a + m`` and ``mlp`` the MLP branch ``m`` added to the residual (detached)
    mlp: Tensor | None = None
    #: ``out``'s backward hands ``A`` and ``A ⊙ ∂y/∂A`` to ``Recording.on_probabilities`` (``_probabilities_backward``)
    probabilities_in_backward: bool = False


@dataclass
class Recording:
    """Tensors captured during one forward pass, in block order."""

    blocks: list[BlockRecord] = field(default_factory=list)
    final: Tensor | None = None
    recompute: bool = False
    #: set before the forward of a ``recompute`` session: each fused attention's backward is computed from its
    #: recomputed probabilities and calls ``on_probabilities(block, A, F = A ⊙ ∂y/∂A, Σ_j F_ij, ‖v‖)``
    #: (``_probabilities_backward``; families that do not offer it ignore it and leave
    #: ``BlockRecord.probabilities_in_backward`` False)
    on_probabilities: Sink | None = None

    def graph_tensors(self) -> list[Tensor]:
        """All captured tensors that are part of the autograd graph (for :func:`torch.autograd.grad`)."""
        out: list[Tensor] = []
        for b in self.blocks:
            out += [t for t in (b.u, b.h, b.attn, b.out) if t is not None]
        if self.final is not None:
            out.append(self.final)
        return out


_T = TypeVar("_T")


def recorded(value: _T | None, what: str) -> _T:
    """``value`` as the capture hooks filled it in (a :class:`BlockRecord` or :class:`Recording` field), or an
    :class:`UnsupportedModelError` naming ``what`` was not recorded: an adapter that declares a capability its capture
    hooks do not fill fails here with one clear line, not with an ``AttributeError`` on ``None`` in a method."""
    if value is None:
        raise UnsupportedModelError(f"the model's recording has no {what}: its adapter declares the capability but "
                                    "its capture hooks did not fill it")
    return value


def _is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a token-wise RMS normalisation (``x / rms(x) · weight``): ``torch.nn.RMSNorm`` or
    timm's ``RmsNorm`` / ``RmsNormFp32``. Not covered (left non-conservative): channel-wise 2-d variants
    (``RmsNorm2d``), timm's ``SimpleNorm`` (divides by the unbiased std without centering) and HuggingFace's
    per-model RMSNorm classes (some scale by ``1 + weight``)."""
    rms = getattr(nn, "RMSNorm", None)
    if rms is not None and isinstance(module, rms):
        return True
    if type(module).__name__ not in _TIMM_RMS_NORMS:
        return False
    return type(module).__module__.startswith("timm.")


_TIMM_RMS_NORMS = ("RmsNorm", "RmsNormFp32")


def conservative_layernorm_hook(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
    """Forward hook that recomputes a LayerNorm (or an RMSNorm) with its scale detached from the graph.

    The forward value is unchanged (up to float rounding); in the backward pass the normalisation acts as a linear map
    (LayerNorm: centering, then division by a constant; RMSNorm: division by a constant), so gradient × input is
    conserved through it (Ali et al., ICML 2022). The statistics are computed in at least float32, so the hook also
    works for half-precision models.
    """
    x = inputs[0]
    if not _is_rms_norm(module) and x.dtype in (torch.float32, torch.float64) and isinstance(module, nn.LayerNorm):
        from ._conservative_ln import constant_std_layer_norm  # one fused forward; only 1/std kept for the backward

        return constant_std_layer_norm(x, module.weight, module.bias, module.normalized_shape, module.eps).to(
            output.dtype)
    shape = getattr(module, "normalized_shape", None) or (x.shape[-1],)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dims = tuple(range(-len(shape), 0))
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    eps = getattr(module, "eps", None)
    eps = torch.finfo(xf.dtype).eps if eps is None else float(eps)
    if _is_rms_norm(module):
        y = xf / (xf.pow(2).mean(dim=dims, keepdim=True) + eps).sqrt().detach()
    else:
        mean = xf.mean(dim=dims, keepdim=True)
        var = xf.var(dim=dims, unbiased=False, keepdim=True)
        y = (xf - mean) / (var + eps).sqrt().detach()
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(output.dtype)


def normalisation_layers(model: nn.Module) -> list[nn.Module]:
    """The ``LayerNorm`` and ``RMSNorm`` modules of ``model`` (torch's and timm's classes), in module order."""
    return [m for m in model.modules() if isinstance(m, nn.LayerNorm) or _is_rms_norm(m)]


class Adapter:
    """Base adapter: the declared interface between vitlens and a model family. Subclasses fill in the parts their
    family supports; every member has a docstring and a default (a neutral value, or an error that says what is
    missing). Explainers, metrics, the image loader, the sanity check and the training commands ask a model only
    through these members.

    Attributes (set by subclasses):
        model: the wrapped ``nn.Module``.
        family: short name of the model family (e.g. ``"timm-vit"``).
        capabilities: the named capabilities the adapter provides (:mod:`vitlens.models.capabilities`: attention
            probabilities, block inputs/outputs, one token sequence or windows or class attention or stages, declared
            LRP linears, token dropping, feature layers, token grid, class or per-pixel logits, ...). Methods declare
            what they need; :mod:`vitlens.explainers.support` decides from the two whether a method runs.
        capability_notes: capability → why this family does not provide it (the refusal a method that needs it
            raises quotes it, e.g. ``"tokens"``: RoPE is tied to token positions).
        fallback_reason: set on the generic adapter when a family adapter recognised the model but could not read
            it (why; quoted by refusals).
        num_prefix_tokens: tokens before the patch tokens (CLS, DIST, registers).
        readout_tokens: indices of the tokens the classifier reads, or ``None`` for pooled readouts.
        num_classes: size of the model's output.
        patch_size: ``(ph, pw)`` pixels per token, or ``None`` for models without a patch grid (CNNs, generic).
        in_chans: input channels the model expects, or ``None`` if unknown (not checked).
        default_size: ``(H, W)`` the model was built for, or ``None`` if it has none or it is unknown.
        any_size: whether :meth:`check_input` accepts other input sizes (multiples of the patch size, e.g. through
            position-embedding interpolation or RoPE); ``False``: only ``default_size``.
    """

    family: str = "base"
    capabilities: frozenset[str] = frozenset({CLASS_LOGITS})
    capability_notes: dict[str, str] = {}
    fallback_reason: str | None = None

    @staticmethod
    def matches(model: nn.Module) -> bool:
        """Whether this adapter class handles ``model``: :func:`~vitlens.models.get_adapter` asks every registered
        adapter in order. Every registered adapter defines it; the base recognises no model."""
        return False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.num_prefix_tokens: int = 0
        self.readout_tokens: tuple[int, ...] | None = None
        self.num_classes: int = 0
        self.patch_size: tuple[int, int] | None = None
        self.in_chans: int | None = None
        self.default_size: tuple[int, int] | None = None
        self.any_size: bool = True

    # -- what the family provides -------------------------------------------------------------------------------
    def provides(self, capability: str) -> bool:
        """Whether the adapter provides ``capability`` (a name from :mod:`vitlens.models.capabilities`)."""
        return capability in self.capabilities

    def lacking(self, capability: str) -> str:
        """Why the adapter does not provide ``capability``: its :attr:`capability_notes` entry, the reason the family
        adapter could not read the model (:attr:`fallback_reason`), or a plain statement."""
        note = self.capability_notes.get(capability)
        if note is not None:
            return note
        if self.fallback_reason is not None:
            return self.fallback_reason
        return f"the {self.family} adapter does not provide it"

    @property
    def windowed(self) -> bool:
        """Whether the attention is windowed (:data:`~vitlens.models.capabilities.WINDOWS`)."""
        return WINDOWS in self.capabilities

    @property
    def class_attention(self) -> bool:
        """Whether the model ends in class-attention blocks
        (:data:`~vitlens.models.capabilities.CLASS_ATTENTION`)."""
        return CLASS_ATTENTION in self.capabilities

    @property
    def hierarchical(self) -> bool:
        """Whether the model has stages with their own token grids (:data:`~vitlens.models.capabilities.STAGES`)."""
        return STAGES in self.capabilities

    def data_config(self) -> Any:
        """The preprocessing the model expects, a :class:`vitlens.images.DataConfig` (input size, mean/std,
        interpolation, crop). Default: :func:`vitlens.images.data_config` of the model (timm's pretrained config,
        the HF processor defaults of the family, or the model's ``vitlens_data_config``); raises
        :class:`UnsupportedModelError` when none can be derived."""
        return model_data_config(self.model)

    def architecture(self) -> str:
        """The model's architecture name: timm's ``pretrained_cfg["architecture"]`` (e.g. ``"vit_small_patch16_224"``),
        else the class name. Names the target in AHA's metadata and finds the explainer shipped for it."""
        cfg = getattr(self.model, "pretrained_cfg", None)
        if isinstance(cfg, dict) and cfg.get("architecture"):
            return str(cfg["architecture"])
        return type(self.model).__name__

    def classifier_modules(self) -> list[nn.Module]:
        """The classifier head module(s), with parameters (the first stage of a cascading randomisation check).

        Default: timm's ``get_classifier()`` (a tuple for distilled models), else the HuggingFace names
        ``classifier`` / ``cls_classifier`` + ``distillation_classifier``; raises :class:`UnsupportedModelError` if
        none is found.
        """
        model = self.model
        getter = getattr(model, "get_classifier", None)
        if callable(getter):
            got = getter()
            heads = list(got) if isinstance(got, (tuple, list)) else [got]
        else:
            names = ("classifier", "cls_classifier", "distillation_classifier")
            heads = [getattr(model, n) for n in names if isinstance(getattr(model, n, None), nn.Module)]
        heads = [h for h in heads if isinstance(h, nn.Module) and any(True for _ in h.parameters())]
        if not heads:
            raise UnsupportedModelError(
                f"cannot find the classifier head of {type(model).__name__} (looked for get_classifier(), classifier)"
            )
        return heads

    def stream_logits(self, tokens: Tensor) -> Tensor:
        """Logits ``(B, K)`` of the model's final norm, readout and head on ``tokens`` ``(B, T, D)``, the residual stream
        after any block (:data:`~.capabilities.STREAM_HEAD`; LeGrad). Default: :class:`UnsupportedModelError`."""
        raise UnsupportedModelError(f"{type(self.model).__name__} ({self.family}) reads no intermediate block's tokens")

    def stage_container(self) -> tuple[str, list[nn.Module]] | None:
        """For models without transformer blocks: the model's own stage container as ``(attribute name, stages input
        side first)`` (the ``blocks``/``stages``/``layers``/``features`` child of timm CNNs), or ``None``."""
        for name in ("blocks", "stages", "layers", "features"):
            container = getattr(self.model, name, None)
            if isinstance(container, (nn.Sequential, nn.ModuleList)) and len(container) > 0:
                return name, list(container)
        return None

    # -- layout --------------------------------------------------------------------------------------------------
    def feature_grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """The grid of the feature layers' tokens (Grad-CAM's map); default :meth:`grid`. Hierarchical families whose
        features are on a coarser grid (Swin's last stage) override it."""
        return self.grid(input_hw)

    def feature_prefix_tokens(self) -> int:
        """Tokens before the patch tokens in the feature layers' tensors (what Grad-CAM leaves out); default
        :attr:`num_prefix_tokens`. CaiT: 0 (its CLS token joins only in the class-attention blocks)."""
        return self.num_prefix_tokens

    def grid(self, input_hw: tuple[int, int]) -> tuple[int, int]:
        """Token grid ``(gh, gw)`` for an input of spatial size ``input_hw``."""
        raise UnsupportedModelError(f"{type(self.model).__name__} ({self.family}) has no token grid")

    def check_input(self, x: Tensor) -> None:
        """Raise :class:`InputError` if ``x`` cannot be fed to the model (size, channels). Default: checks
        :attr:`in_chans` when it is known."""
        if self.in_chans is not None and x.shape[1] != self.in_chans:
            raise InputError(f"model expects {self.in_chans} input channels; got a batch with {x.shape[1]}")

    def dtype(self) -> torch.dtype:
        """The floating dtype of the model's parameters (inputs are cast to it); float32 for a model without
        floating parameters."""
        for p in self.model.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.float32

    # -- running -------------------------------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, K)`` of the model for input ``x`` (families: :meth:`_forward`). Inside
        :meth:`caller_autocast` the model runs under the caller's ``torch.autocast``."""
        amp = getattr(self, "_caller_amp", None)
        if amp is None:
            return self._forward(x)
        with torch.autocast(amp[0], dtype=amp[1]):
            return self._forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        """The family's forward: logits of the model for ``x``."""
        return logits_of(self.model(x))

    @contextlib.contextmanager
    def caller_autocast(self, device_type: str) -> Iterator[None]:
        """Keep the caller's ``torch.autocast`` (if enabled for ``device_type``) for the model's forward passes
        (:meth:`forward`) and switch it off for everything else in the context, so an explainer's own arithmetic
        (relevance propagation, normalisation, sums) runs in full precision. Restored on exit."""
        if not torch.is_autocast_enabled(device_type):
            yield
            return
        saved = getattr(self, "_caller_amp", None)
        self._caller_amp: tuple[str, torch.dtype] | None = (device_type, torch.get_autocast_dtype(device_type))
        try:
            with torch.autocast(device_type, enabled=False):
                yield
        finally:
            self._caller_amp = saved

    def blocks(self) -> Sequence[nn.Module]:
        """The transformer blocks, in order. Raises ``NotImplementedError`` for models without transformer blocks
        (CNNs, generic modules)."""
        raise NotImplementedError(f"{type(self.model).__name__} ({self.family}) has no transformer blocks")

    def lrp_linears(self) -> list[LRPLinears]:
        """Per block, the linear maps LRP rules act on (:class:`LRPLinears`), for the LRP methods (CP-LRP, AttnLRP,
        transformer attribution). Default: :class:`UnsupportedModelError`; pre-norm families with a plain attention
        and a two-layer MLP declare theirs (built with :func:`linears_at`)."""
        raise UnsupportedModelError(f"{type(self.model).__name__} ({self.family}) declares no linear maps for LRP rules")

    def feature_layers(self) -> Sequence[nn.Module]:
        """The layers whose features (``BlockRecord.u``, ``(B, T, D)``) feature methods such as Grad-CAM may read;
        for transformers the blocks (layer ``l``: the residual stream entering block ``l``)."""
        return self.blocks()

    def layernorms(self) -> list[nn.Module]:
        """Normalisations treated as linear in the backward pass in conservative mode (blocks and final norms):
        ``LayerNorm`` and token-wise ``RMSNorm`` (see :func:`normalisation_layers`)."""
        return normalisation_layers(self.model)

    def _install_capture(self, rec: Recording, hooks: list) -> None:
        """Register the family-specific capture hooks, appending their handles to ``hooks``."""
        raise UnsupportedModelError(f"{type(self.model).__name__} ({self.family}) has no attention capture")

    def _new_recording(self) -> Any:
        """The object the capture hooks fill: a :class:`Recording` (one token sequence); families with another
        layout (hierarchical stages) return their own."""
        return Recording()

    @contextlib.contextmanager
    def _explicit_attention(self) -> Iterator[None]:
        """Family hook: switch attention to the explicit (attention-matrix computing) path for the duration of the
        context, restoring it on exit. Default: nothing to switch."""
        yield

    def recomputes_attention(self) -> bool:
        """Whether a ``session(recompute=True)`` keeps this model's attention as it runs (fused) and records queries,
        keys, values and the attention output instead of the probabilities. Default: no (explicit attention)."""
        return False

    @contextlib.contextmanager
    def explicit_attention(self) -> Iterator[None]:
        """Run the model's attention on its explicit path (timm ``fused_attn = False``, HF eager attention) within
        the context, restored on exit also after an exception; for callers outside a :meth:`session` (e.g. training
        commands that want the explicit path for speed)."""
        with self._explicit_attention():
            yield

    @contextlib.contextmanager
    def readout_only(self, all_queries: bool = True) -> Iterator[bool]:
        """The readout fast path, where the family offers one: within the context the last block computes its
        outputs on the readout tokens only (same logits up to float rounding, same gradients to every earlier
        tensor; ``all_queries`` keeps every attention row). Yields whether it is active. Default: not offered
        (the model runs unchanged, ``False``); timm ViT: :mod:`vitlens.models._readout`."""
        yield False

    @contextlib.contextmanager
    def session(self, capture: bool = True, conservative: bool = False,
                recompute: bool = False) -> Iterator[Recording]:
        """Context in which :meth:`forward` records a :class:`Recording`.

        Puts the model in eval mode, switches on explicit attention (if ``capture``; with ``recompute`` where
        :meth:`recomputes_attention`, the attention runs as the model has it and the record holds what the
        probabilities are recomputed from, see the module docstring), makes the residual stream at the
        first block a fresh leaf that requires grad (so the backward stops there and works with frozen parameters),
        and optionally makes LayerNorms conservative. Parameters are frozen for the duration (activation gradients
        only). Everything is restored on exit, also after an exception.
        """
        model = self.model
        modes = {m: m.training for m in model.modules()}
        grads = {p: p.requires_grad for p in model.parameters()}
        hooks: list[Any] = []
        rec = self._new_recording()
        try:
            model.eval()
            for p in grads:
                p.requires_grad_(False)
            with contextlib.ExitStack() as stack:
                if capture:
                    if recompute and self.recomputes_attention():
                        rec.recompute = True
                    else:
                        stack.enter_context(self._explicit_attention())
                    self._install_capture(rec, hooks)
                if conservative:
                    for ln in self.layernorms():
                        hooks.append(ln.register_forward_hook(conservative_layernorm_hook))
                yield rec
        finally:
            for hnd in hooks:
                hnd.remove()
            for p, flag in grads.items():
                p.requires_grad_(flag)
            for m, flag in modes.items():
                m.training = flag

    def _embedding_module(self) -> nn.Module:
        """The module whose output is the token sequence with position embeddings added (before the blocks)."""
        raise UnsupportedModelError(f"{type(self.model).__name__} ({self.family}) cannot run on a subset of tokens")

    @contextlib.contextmanager
    def keep_tokens(self, keep: Tensor) -> Iterator[None]:
        """Run the model on a subset of patch tokens (each with its own position embedding) within the context.

        ``keep``: ``(B, k)`` long indices into the patch tokens (row-major on the token grid) for each image of the
        batch that :meth:`forward` will receive. Prefix tokens are always kept. Tokens are dropped after the
        embeddings: no replacement value is used (as TIS and MUTEX require). Needs the ``"tokens"`` capability.
        """
        if keep.ndim != 2 or keep.dtype != torch.long:
            raise InputError(f"keep must be a (B, k) long tensor, got {tuple(keep.shape)} {keep.dtype}")
        p = self.num_prefix_tokens

        def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
            if out.shape[0] != keep.shape[0]:
                raise InputError(f"keep has {keep.shape[0]} rows for a batch of {out.shape[0]}")
            n_patch = out.shape[1] - p
            if int(keep.max()) >= n_patch or int(keep.min()) < 0:
                raise InputError(f"keep indices must be in [0, {n_patch}) patch tokens")
            idx = keep.to(out.device)[:, :, None].expand(-1, -1, out.shape[-1])
            return torch.cat([out[:, :p], out[:, p:].gather(1, idx)], dim=1)

        handle = self._embedding_module().register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()

    # -- helpers for subclasses ------------------------------------------------------------------------------------
    @staticmethod
    def _leaf_first_block_hook(rec: Recording, index: int) -> Callable:
        """Pre-hook for block ``index``: records ``u``; for block 0, replaces it by a leaf that requires grad."""

        def hook(module: nn.Module, args: tuple, kwargs: dict):
            if args:
                u = args[0]
            else:
                key = next(iter(kwargs))
                u = kwargs[key]
            replaced = False
            if index == 0:
                u = u.detach().requires_grad_(True)
                replaced = True
            while len(rec.blocks) <= index:
                rec.blocks.append(BlockRecord())
            rec.blocks[index].u = u
            if not replaced:
                return None
            if args:
                return (u, *args[1:]), kwargs
            kwargs = dict(kwargs)
            kwargs[key] = u
            return args, kwargs

        return hook

    @staticmethod
    def _record_h_hook(rec: Recording, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple):
            rec.blocks[index].h = args[0]

        return hook


@contextlib.contextmanager
def switched(modules: Sequence[Any], name: str, value: object) -> Iterator[None]:
    """Set attribute ``name`` of every module to ``value`` for the duration of the context, restored on exit (also
    after an exception); e.g. timm's ``fused_attn = False`` for explicit attention."""
    saved = [getattr(m, name) for m in modules]
    try:
        for m in modules:
            setattr(m, name, value)
        yield
    finally:
        for m, old in zip(modules, saved):
            setattr(m, name, old)


def logits_of(out: Any) -> Tensor:
    """Extract logits from a model output (tensor, tuple or HuggingFace output object)."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise InputError(f"cannot find logits in the model output of type {type(out).__name__}")


_logits_of = logits_of  # the former private name, kept for code that imported it

"""The shared explainer machinery: input checks, targets, batching, upsampling and cost accounting live here once.

A method is a small subclass of :class:`Explainer` that declares its ``name``, its option ``defaults``, the adapter
capability it needs, and implements :meth:`Explainer.attribute` for one chunk of images.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._version import __version__
from ..errors import InputError
from ..models import Adapter, get_adapter
from ..models.base import Recording, logits_of
from ..options import OptionSpec, check_like_default, check_option, check_option_for_input
from ..targets import Target, TargetSpec, make_target
from .registry import Method, method_classes
from .support import check

__all__ = ["Explainer", "check_choices", "Explanation", "Attribution", "Cost", "CostMeter", "image_size", "upsample_tokens",
           "validate_batch"]


@dataclass
class Cost:
    """What an explanation cost.

    ``forward_passes``/``backward_passes`` are per image, in units of one full forward (backward) pass of the target
    model on one image (a batched call on B images counts B image-passes, divided by the number of images
    explained). ``model_calls``/``backward_calls`` count the actual (batched) calls. ``seconds`` is wall time.
    """

    forward_passes: float = 0.0
    backward_passes: float = 0.0
    model_calls: int = 0
    backward_calls: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class CostMeter:
    """Counts forward calls (and the images in them) and backward passes through a model's output.

    Use as a context manager around the work to measure; hooks are removed on exit.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.calls = 0
        self.images = 0
        self.backward_calls = 0
        self.backward_images = 0
        self._handle: Any = None
        self._t0 = 0.0
        self.seconds = 0.0

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.calls += 1
        x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
        n = int(x.shape[0]) if isinstance(x, Tensor) and x.ndim > 0 else 1
        self.images += n
        logits = logits_of(output)
        if logits.requires_grad:

            def count(grad: Tensor, n: int = n) -> None:
                self.backward_calls += 1
                self.backward_images += n

            logits.register_hook(count)

    def __enter__(self) -> "CostMeter":
        self._handle = self.model.register_forward_hook(self._hook, with_kwargs=True)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds += time.perf_counter() - self._t0
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def cost(self, n_images: int) -> Cost:
        n = max(n_images, 1)
        return Cost(
            forward_passes=self.images / n,
            backward_passes=self.backward_images / n,
            model_calls=self.calls,
            backward_calls=self.backward_calls,
            seconds=self.seconds,
        )


@dataclass
class Attribution:
    """What :meth:`Explainer.attribute` returns for one chunk of ``B`` images.

    ``values`` is ``(B, gh, gw)`` for token-level methods or ``(B, H, W)`` for pixel-level methods. ``remainder`` is
    the relevance that ended outside the map (prefix tokens), ``(B,)``, where the method conserves relevance.
    ``extras`` holds per-image diagnostics with a leading batch dimension.
    """

    values: Tensor
    remainder: Tensor | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class Explanation:
    """Maps for a batch of images, with what was explained and what it cost.

    Attributes:
        maps: ``(B, H, W)`` float, at input resolution. For token-level methods this is the token map bilinearly
            upsampled and divided by the pixels per token, so ``maps.sum()`` equals ``token_maps.sum()`` (exactly for
            integer upsampling factors; see docs/methods/gradskip.md).
        token_maps: ``(B, gh, gw)`` on the model's token grid (pixel-level methods: summed over each token's pixels),
            or ``None`` for models without a token grid.
        targets: ``(B,)`` long, class explained per image.
        scores: ``(B,)`` float, the target score ``y`` per image.
        remainder: ``(B,)`` relevance that ended on prefix tokens (methods that conserve relevance), else ``None``.
        cost: :class:`Cost` of the call.
        method: registered method name. options: the options used. target: description of the target.
        extras: per-image diagnostics (e.g. GradSkip head weights ``(B, L, heads)`` and gates ``(B, L, T)``).
    """

    maps: Tensor
    token_maps: Tensor | None
    targets: Tensor
    scores: Tensor
    remainder: Tensor | None
    cost: Cost
    method: str
    options: dict[str, Any]
    target: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.maps.shape[0])

    def __repr__(self) -> str:
        """One line: method, options that differ from its defaults, shapes, targets (first few), cost."""
        targets = self.targets.tolist()
        shown = ", ".join(str(t) for t in targets[:6]) + (", …" if len(targets) > 6 else "")
        tokens = "None" if self.token_maps is None else tuple(self.token_maps.shape)
        defaults = getattr(method_classes().get(self.method), "defaults", {})
        options = "".join(f", {k}={v!r}" for k, v in self.options.items()  # only what differs from the defaults
                          if k not in defaults or not _same(defaults[k], v))
        return (f"Explanation(method={self.method!r}{options}, maps={tuple(self.maps.shape)}, token_maps={tokens}, "
                f"targets=[{shown}], cost={self.cost.forward_passes:g} fwd + {self.cost.backward_passes:g} bwd "
                f"per image in {self.cost.seconds:.3g} s)")

    def provenance(self) -> dict[str, Any]:
        """JSON-friendly record of how these maps were made (versions, method, options, target, cost)."""
        import platform

        info: dict[str, Any] = {
            "vitlens": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "method": self.method,
            "options": _jsonable(self.options),
            "target": _jsonable(self.target),
            "targets": self.targets.tolist(),
            "scores": self.scores.tolist(),
            "cost": self.cost.to_dict(),
        }
        for mod in ("timm", "transformers"):
            with contextlib.suppress(ImportError):
                info[mod] = __import__(mod).__version__
        return info


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # tensors and other values without a plain truth value
        return a is b


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        return repr(obj)


def validate_batch(x: Any) -> Tensor:
    """Check that ``x`` is a non-empty, finite, floating ``(B, C, H, W)`` tensor; raise :class:`InputError` if not."""
    if not isinstance(x, Tensor):
        raise InputError(
            f"expected a torch.Tensor batch of shape (B, C, H, W), got {type(x).__name__} "
            "(use vitlens.load_images to turn files, PIL images or arrays into a batch)"
        )
    if x.ndim != 4:
        hint = " (add a batch dimension: x[None])" if x.ndim == 3 else ""
        raise InputError(f"expected a batch of shape (B, C, H, W); got a tensor of shape {tuple(x.shape)}{hint}")
    if x.shape[0] == 0:
        raise InputError("the batch is empty (B = 0)")
    if x.device.type == "meta":
        raise InputError("the batch is on the 'meta' device (shapes only, no values): there is nothing to explain")
    if not x.is_floating_point():
        raise InputError(f"expected a floating-point batch, got dtype {x.dtype} (preprocess with vitlens.load_images)")
    if not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).flatten(1).any(1).nonzero().flatten().tolist()
        raise InputError(f"the batch contains NaN or inf values (images {bad[:5]})")
    return x


def check_choices(options: dict[str, Any], **allowed: Sequence[str]) -> None:
    """Raise :class:`InputError` unless each option named in ``allowed`` has one of its allowed values."""
    for name, values in allowed.items():
        if options[name] not in values:
            raise InputError(f"{name} must be one of {values}, got {options[name]!r}")


def image_size(x: Tensor) -> tuple[int, int]:
    """``(H, W)`` of an image batch ``(B, C, H, W)`` (or of any tensor's last two dimensions)."""
    return int(x.shape[-2]), int(x.shape[-1])


def upsample_tokens(token_maps: Tensor, size: tuple[int, int]) -> Tensor:
    """Bilinearly upsample ``(B, gh, gw)`` token maps to ``(B, H, W)`` relevance per pixel.

    The result is divided by the number of pixels per token, so the total relevance is kept (exactly for integer
    factors; bilinear interpolation with half-pixel centres gives every token the same total weight then).
    """
    b, gh, gw = token_maps.shape
    h, w = size
    up = F.interpolate(token_maps[:, None].float(), size=(h, w), mode="bilinear", align_corners=False)[:, 0]
    return up * (gh * gw) / (h * w)


def pool_to_tokens(maps: Tensor, grid: tuple[int, int]) -> Tensor:
    """Sum a pixel map ``(B, H, W)`` over each token's cell of a ``grid`` → ``(B, gh, gw)``."""
    b, h, w = maps.shape
    gh, gw = grid
    if h % gh == 0 and w % gw == 0:
        return maps.reshape(b, gh, h // gh, gw, w // gw).sum(dim=(2, 4))
    return F.adaptive_avg_pool2d(maps[:, None], grid)[:, 0] * (h * w) / (gh * gw)


class Explainer(Method):
    """Base class of all explanation methods.

    Subclasses set ``name``, ``description`` (one plain line), ``defaults`` (option name → default value),
    ``needs`` (the adapter capabilities it needs, :mod:`vitlens.models.capabilities`; ``()`` for model-agnostic
    methods; :meth:`~vitlens.explainers.registry.Method.required` when they depend on the options), ``level``
    (``"token"`` or ``"pixel"``) and implement :meth:`attribute`.
    Each option declares its type and range in ``option_specs`` (helpers of :mod:`vitlens.options`: ``integer``,
    ``number``, ``choice``, ``grid_cells``, ...): unknown names, wrong types and values out of range are refused when
    the method is made, ranges that depend on the image when the input arrives, each in one line naming the method,
    the option, the value and the allowed range. :meth:`check_options` adds checks across options.
    """

    name: ClassVar[str] = ""
    defaults: dict[str, Any] = {}
    level: ClassVar[str] = "token"
    #: cheap settings for the shared property tests (e.g. fewer masks or steps); never used by default.
    fast_options: dict[str, Any] = {}
    #: whether batch results equal one-by-one results (False for methods whose randomness is shared by the batch).
    batch_equivariant: ClassVar[bool] = True
    #: options whose default is a number but which also accept ``None`` (documented meaning, e.g. "all at once").
    nullable_options: ClassVar[frozenset[str]] = frozenset({"internal_batch_size"})
    #: option name → its declared type and range, one per option of ``defaults`` (``tests/test_option_ranges.py``
    #: holds every registered method to it). An option without one only gets the type check of its default.
    option_specs: ClassVar[dict[str, OptionSpec]] = {}
    #: True for methods that read only the model's logits (no capture): their calls run the adapter's readout fast
    #: path where it offers one (``Adapter.readout_only``: the last block on the readout tokens only; same maps up to
    #: float rounding).
    readout_logit_only: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise InputError(
                f"unknown option(s) {', '.join(unknown)} for method '{self.name}'; "
                f"options are: {', '.join(sorted(self.defaults)) or 'none'}"
            )
        owner, specs = f"method '{self.name}'", self.option_specs
        # each option against its declared range; an option declared nowhere against the type of its default
        check_like_default(owner, {k: v for k, v in options.items() if k not in specs}, self.defaults,
                           self.nullable_options)
        given = {k: check_option(owner, k, specs[k], v) if k in specs else v for k, v in options.items()}
        self.options: dict[str, Any] = {**self.defaults, **given}
        self.check_options()

    def check_options(self) -> None:
        """Checks across options (``option_specs`` holds each one's range); raise :class:`InputError` in one line."""

    def check_input_options(self, shape: tuple[int, ...]) -> None:
        """Refuse an option whose range depends on the input (a grid of more cells than the image has pixels) in
        one line, for an input batch of ``shape`` ``(B, C, H, W)``."""
        for key, spec in self.option_specs.items():
            if key in self.options:
                check_option_for_input(f"method '{self.name}'", key, spec, self.options[key], shape)

    def declared_cost(self) -> dict[str, float]:
        """Cost per image with the current options, in passes of the target model: ``{"forward": …, "backward": …}``.

        A forward on a subset of tokens counts as one forward (add ``"token_fraction"`` to say how many tokens).
        The shared property tests check it against the measured :class:`Cost`.
        """
        return {"forward": 1.0, "backward": 1.0}

    def attribute(self, adapter: Adapter, x: Tensor, target: Target) -> tuple[Attribution, Tensor, Target]:
        """Explain one chunk: return the attribution, the logits ``(B, K)`` and the resolved target."""
        raise NotImplementedError

    # -- steps that attribute() implementations share ------------------------------------------------------------
    @staticmethod
    def resolve_target(target: Target, logits: Tensor) -> Target:
        """``target`` with every class index fixed for these logits (``None`` → the predicted class); a target that
        is already resolved (e.g. a chunk of a resolved batch target) is returned as is."""
        return target if target.classes is not None else target.resolve(logits)

    @staticmethod
    def gradients(score: Tensor, wrt: Sequence[Tensor]) -> list[Tensor]:
        """Gradients of ``score.sum()`` w.r.t. each captured tensor of ``wrt``; zeros for a tensor the score does not
        depend on (e.g. the attention of a block after the readout's last use)."""
        wrt = list(wrt)
        grads = torch.autograd.grad(score.sum(), wrt, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads)]

    def forward_and_gradients(self, adapter: Adapter, x: Tensor, target: Target,
                              pick: Callable[[Recording], list[Tensor]], *, conservative: bool = False,
                              retarget: Callable[[Target, Tensor], Target] | None = None,
                              ) -> tuple[Tensor, Target, list[Tensor], list[Tensor]]:
        """One forward with capture, the target resolved on its logits, one backward to the tensors ``pick(rec)``.

        ``retarget(resolved_target, logits)`` may replace the resolved target (Finer-CAM). Returns ``(logits
        (detached), target, picked tensors (detached), their gradients)``.
        """
        with adapter.session(capture=True, conservative=conservative) as rec:
            logits = adapter.forward(x)
            tgt = self.resolve_target(target, logits)
            if retarget is not None:
                tgt = retarget(tgt, logits)
            picked = pick(rec)
            grads = self.gradients(tgt(logits), picked)
        return logits.detach(), tgt, [t.detach() for t in picked], grads

    @staticmethod
    def on_grid(adapter: Adapter, values: Tensor, hw: tuple[int, int], features: bool = False) -> Tensor:
        """``(B, N)`` patch-token values → ``(B, gh, gw)`` on the model's own token grid for input size ``hw``
        (``features``: the feature layers' grid, :meth:`Adapter.feature_grid`; :class:`InputError` if the ``N``
        tokens do not fill the grid)."""
        gh, gw = adapter.feature_grid(hw) if features else adapter.grid(hw)
        if values.shape[1] != gh * gw:
            raise InputError(f"{values.shape[1]} patch tokens do not fill the {gh}x{gw} token grid")
        return values.reshape(values.shape[0], gh, gw)

    # -- the shared driver --------------------------------------------------------------------------------------
    def explain(self, model: nn.Module | Adapter, x: Tensor, target: TargetSpec = None,
                batch_size: int | None = None) -> Explanation:
        """Explain a batch ``x`` ``(B, C, H, W)`` (preprocessed, as the model expects it) for ``target``.

        ``batch_size`` splits the batch into chunks (memory knob; results do not depend on it).
        Inside ``torch.inference_mode()`` the explanation runs with inference mode switched off for its duration (a
        batch made there is copied first: inference tensors cannot be differentiated); a model whose parameters
        were made there is refused in one line, as are (at the end) the caller's modes restored.
        """
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                if isinstance(x, Tensor) and x.is_inference():
                    x = x.clone()
                return self.explain(model, x, target, batch_size)
        adapter = get_adapter(model)
        check(adapter, self)  # the one refusal path: what the method needs and the adapter lacks
        _refuse_meta_parameters(adapter.model)
        _refuse_inference_parameters(adapter.model)
        x = validate_batch(x)
        self.check_input_options(tuple(x.shape))
        device = _model_device(adapter.model)
        if device is not None and x.device != device:
            x = x.to(device)
        x = x.to(adapter.dtype())  # fp16/bf16/fp64 models get their dtype (torch.autocast still applies inside)
        adapter.check_input(x)
        tgt = make_target(target).bind(adapter)  # text targets: the model's text side, once per call
        if getattr(adapter.model, "num_classes", None) == 0 and hasattr(adapter.model, "reset_classifier") and \
                not getattr(tgt, "scores_embeddings", False):  # a TextEmbedding scores an image tower's features
            from ..errors import TargetError

            raise TargetError(f"{type(adapter.model).__name__} has no classifier head (num_classes=0): its output "
                              "is features, not class scores, so there is no class to explain")
        b = x.shape[0]
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size <= 0):
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        chunk = b if batch_size is None else batch_size
        parts: list[tuple[Attribution, Tensor, Target]] = []
        meter = CostMeter(adapter.model)
        fast = adapter.readout_only(all_queries=False) if self.readout_logit_only else contextlib.nullcontext()
        # gradient methods also work inside torch.no_grad(); a caller's autocast applies to the model's forwards only
        with meter, torch.enable_grad(), adapter.caller_autocast(x.device.type), fast:
            for start in range(0, b, chunk):
                sl = slice(start, min(start + chunk, b))
                parts.append(self.attribute(adapter, x[sl], tgt.chunk(sl, b)))
        values = torch.cat([p[0].values.detach() for p in parts])
        rems = [p[0].remainder for p in parts]  # the same method on every chunk: all or none have one
        remainder = torch.cat([r.detach() for r in rems if r is not None]) if rems[0] is not None else None
        extras = {k: torch.cat([p[0].extras[k].detach() for p in parts]) for k in parts[0][0].extras}
        targets = torch.cat([p[2].resolved_classes() for p in parts])
        scores = torch.cat([p[2](p[1]).detach() for p in parts])
        hw = image_size(x)
        has_grid = adapter.patch_size is not None  # a token grid (not only families that can drop tokens)
        token_maps: Tensor | None
        if self.level == "token":
            token_maps = values
            maps = upsample_tokens(values, hw)
        else:
            maps = values
            token_maps = pool_to_tokens(values, adapter.grid(hw)) if has_grid else None
        return Explanation(
            maps=maps.float(),
            token_maps=None if token_maps is None else token_maps.float(),
            targets=targets,
            scores=scores,
            remainder=remainder,
            cost=meter.cost(b),
            method=self.name,
            options=dict(self.options),
            target=tgt.describe(),
            extras=extras,
        )

    __call__ = explain


def _refuse_meta_parameters(model: nn.Module) -> None:
    """One line for a model built on the 'meta' device (shapes only: ``torch.device('meta')``, ``init_empty_weights``,
    ``timm.create_model(..., device='meta')``): it has no weights to run, so nothing can be explained."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type == "meta":
            raise InputError(f"the model's {'parameter' if isinstance(t, nn.Parameter) else 'buffer'} {name} is on the "
                             "'meta' device (a shape, no values): the model has no weights to run; load them first "
                             "(e.g. model.to_empty(device='cpu') then load_state_dict(...))")


def _refuse_inference_parameters(model: nn.Module) -> None:
    """One line for a model whose weights are inference tensors (made or loaded inside ``torch.inference_mode()``):
    autograd cannot record a pass through them, so no explanation can run on it as it is."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_inference():
            raise InputError(f"the model's {'parameter' if isinstance(t, nn.Parameter) else 'buffer'} {name} was made "
                             "inside torch.inference_mode(): its weights are inference tensors, which no explanation "
                             "can run through; create or load the model outside inference mode (torch.no_grad() is "
                             "fine)")


def _model_device(model: nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    return None

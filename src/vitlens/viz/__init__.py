"""Pictures of attribution maps: overlays, figures with colour bars and captions, and method comparison grids.

The last stage of ``image → model adapter → explainer → map → metric/report``:

- :mod:`.pixels` — scale a map for display (signed maps on a diverging colour map centred at 0, magnitude, min-max,
  percentile clipping), blend it over an image, put a map of the model's input view back on the original image
  (:func:`map_to_original`);
- :mod:`.figures` — :func:`save_figure` (image, overlay, colour bar, caption) and :func:`save_grid` (images ×
  methods, with method names and settings, captions and colour bars).

Importing or using this package never changes matplotlib's global backend or pyplot state. Images are pixels in
``[0, 1]`` (or uint8), not model-normalised input: use :func:`vitlens.images.denormalize` first.
"""

from .figures import (JOURNAL_RC, clip_note, colorbar_label, save_figure, save_grid, split_label, target_phrase, tick_labels,
                      wrap_phrases)
from .pixels import (
    ImageLike,
    MapLike,
    STYLES,
    MapNormalization,
    MapStyle,
    Scale,
    default_style,
    display_image,
    kind_normalize,
    smooth_map,
    style_normalize,
    apply_scale,
    default_cmap,
    is_signed,
    map_scale,
    map_to_original,
    normalize_map,
    overlay,
    overlay_with_scale,
    save_overlay,
    scale_map,
    to_uint8,
    upsample_image,
)

__all__ = [
    "ImageLike",
    "MapLike",
    "MapNormalization",
    "MapStyle",
    "STYLES",
    "Scale",
    "default_style",
    "kind_normalize",
    "display_image",
    "smooth_map",
    "style_normalize",
    "to_uint8",
    "is_signed",
    "scale_map",
    "map_scale",
    "apply_scale",
    "normalize_map",
    "default_cmap",
    "upsample_image",
    "overlay",
    "overlay_with_scale",
    "map_to_original",
    "save_overlay",
    "save_figure",
    "save_grid",
    "colorbar_label",
    "target_phrase",
    "split_label",
    "wrap_phrases",
    "tick_labels",
    "clip_note",
    "JOURNAL_RC",
]

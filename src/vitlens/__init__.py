"""vitlens: faithful, fast attribution maps for vision transformers."""

__version__ = "0.1.0"

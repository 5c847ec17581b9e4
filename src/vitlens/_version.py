"""The package version (one place; `vitlens.__version__` and provenance records read it)."""

__version__ = "0.1.0"

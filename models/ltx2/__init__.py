"""LTX-2 (`LTX2Pipeline`): its options, adapter, conditions, soundtrack, stages, windows and embedded default."""

__all__ = ["DEFAULT_NAME"]

DEFAULT_NAME = "tiny-ltx2"
"""The embedded default's name (``models.ltx2.default`` builds it); here so that the family's row of the table
knows it without importing diffusers."""

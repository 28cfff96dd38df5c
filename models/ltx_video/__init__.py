"""LTX-Video (`LTXConditionPipeline`, `LTXPipeline`): its options, adapter, stages, windows and embedded default."""

__all__ = ["DEFAULT_NAME"]

DEFAULT_NAME = "tiny-ltx-video"
"""The embedded default's name (``models.ltx_video.default`` builds it); here so that the family's row of the table
knows it without importing diffusers."""

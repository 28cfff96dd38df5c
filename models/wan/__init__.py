"""Wan (`WanPipeline`, `WanImageToVideoPipeline`): its options, loading, parallel plan, VAE decode, windows and
embedded default."""

__all__ = ["DEFAULT_NAME"]

DEFAULT_NAME = "tiny-wan"
"""The embedded default's name (``models.wan.default`` builds it); here so that the family's row of the table
knows it without importing diffusers."""

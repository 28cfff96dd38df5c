"""Helios (`HeliosPipeline`): long video chunk by chunk, each chunk attending to a multi-scale history of the chunks
before it. Its options, loading, parallel plan, chunks and embedded default."""

__all__ = ["DEFAULT_NAME"]

DEFAULT_NAME = "tiny-helios"
"""The embedded default's name (``models.helios.default`` builds it); here so that the family's row of the table
knows it without importing diffusers."""

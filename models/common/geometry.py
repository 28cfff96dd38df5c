"""What a model's configs say of its video geometry beyond diffusers' own compression ratios."""

from __future__ import annotations

__all__ = ["min_latent_side"]


def min_latent_side(vae_config) -> int:
    """2 for decoders whose convs pad spatially by reflection (LTX-2's), which needs two latent pixels; else 1."""
    return 2 if vae_config.get("decoder_spatial_padding_mode") == "reflect" else 1

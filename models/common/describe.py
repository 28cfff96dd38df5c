"""A model's video geometry and depth from its transformer's and VAE's configs alone (no weights): what the LTX
families describe themselves with (``Family.describe``)."""

from __future__ import annotations

from pathlib import Path

import torch

from cp_infer import VideoGeometry
from models.common.folder_problems import ModelLoadError, component_problem, error_line
from models.common.geometry import min_latent_side

__all__ = ["geometry_from_configs"]


def geometry_from_configs(path: Path, transformer_cls: type, vae_cls: type) -> tuple[VideoGeometry, int]:
    """The geometry and transformer blocks of the folder ``path`` whose transformer and VAE are of these classes."""
    try:
        transformer = transformer_cls.load_config(path, subfolder="transformer", local_files_only=True)
        vae_config = vae_cls.load_config(path, subfolder="vae", local_files_only=True)
        # The compression ratios are diffusers' own arithmetic on the config: build the VAE on the meta
        # device (no memory, no weights) and ask it.
        with torch.device("meta"):
            vae = vae_cls.from_config(vae_config)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        problem = component_problem(path, "transformer", config="config.json") or component_problem(
            path, "vae", config="config.json")
        what = f"{problem} ({error_line(exc)})" if problem else error_line(exc)
        raise ModelLoadError(f"could not read the transformer/ and vae/ configs of {str(path)!r}: {what}") from exc
    geometry = VideoGeometry(
        temporal_compression=vae.temporal_compression_ratio, spatial_compression=vae.spatial_compression_ratio,
        patch_size=transformer.get("patch_size", 1), patch_size_t=transformer.get("patch_size_t", 1),
        min_latent_side=min_latent_side(vae_config),
    )
    return geometry, int(transformer.get("num_layers", 0))

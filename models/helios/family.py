"""Helios's row of the family table (``models.families``): how its folders are recognised, described, loaded,
placed and wrapped. Light at import time: the diffusers classes are imported inside the methods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.helios import DEFAULT_NAME

__all__ = ["FAMILY", "HeliosFamily"]


class HeliosFamily:
    name = "helios"
    title = "Helios"
    pipelines = ("HeliosPipeline", "HeliosPyramidPipeline")
    transformers = ("HeliosTransformer3DModel",)
    upsamplers = ()
    loader = "models.helios.loading.load_helios"
    # As HeliosPipeline's example keeps it (models.helios.loading).
    float32_components = ("vae",)
    has_audio = False
    vae_tiling = False
    transformer_subfolders = ("transformer",)

    default_name = DEFAULT_NAME
    default_help = f"{DEFAULT_NAME} (Helios, chunk by chunk)"

    single_file_classes: dict[str, str] = {}
    """Helios takes no single-file checkpoint (``models.common.single_file``)."""

    def is_single_file_transformer(self, keys: set[str]) -> bool:
        return False

    def ensure_default(self) -> Path:
        from .default import ensure_default_helios_model

        return ensure_default_helios_model()

    def options(self, *, layers: int, latent_upsampler: bool = True, stages: int | None = None,
                distilled: bool = False):
        from .options import helios_options

        return helios_options()

    def describe(self, files):
        from .loading import describe_helios, read_pyramid
        from .options import helios_options

        geometry, layers = describe_helios(files.folder)
        return geometry, layers, helios_options(read_pyramid(files.folder))

    def load(self, files, *, dtype, device, loaders, offloaded=()):
        from .loading import load_helios

        return load_helios(files, dtype=dtype, device=device, loaders=loaders, offloaded=offloaded)

    def wrap(self, components, *, state):
        from .adapter import HeliosModel

        return HeliosModel(components, state=state)

    def component_classes(self, root: Path | None) -> list[tuple[str, Any, bool]]:
        from diffusers import AutoencoderKLWan, HeliosTransformer3DModel
        from transformers import UMT5EncoderModel

        return [("transformer", HeliosTransformer3DModel, False), ("vae", AutoencoderKLWan, False),
                ("text_encoder", UMT5EncoderModel, True)]

    def lora_spec(self):
        from .adapter import LORA

        return LORA

    def step_passes(self, request) -> set[int]:
        from .adapter import plan_request, step_passes

        return {step_passes(p.request) for p in plan_request(request).passes}


FAMILY = HeliosFamily()

"""Wan's row of the family table (``models.families``): how its folders are recognised, described, loaded, placed
and wrapped. Light at import time: the diffusers classes are imported inside the methods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.wan import DEFAULT_NAME

__all__ = ["FAMILY", "WanFamily"]


class WanFamily:
    name = "wan"
    title = "Wan"
    pipelines = ("WanPipeline", "WanImageToVideoPipeline")
    transformers = ("WanTransformer3DModel",)
    upsamplers = ()
    loader = "models.wan.loading.load_wan"
    # As diffusers' Wan examples keep them (models.wan.loading).
    float32_components = ("vae", "image_encoder")
    has_audio = False
    vae_tiling = False
    # transformer_2: Wan 2.2 A14B's low-noise expert (where the folder has it).
    transformer_subfolders = ("transformer", "transformer_2")

    default_name = DEFAULT_NAME
    default_help = f"{DEFAULT_NAME} (Wan 2.1)"

    single_file_classes: dict[str, str] = {}
    """Wan takes no single-file checkpoint (``models.common.single_file``)."""

    def is_single_file_transformer(self, keys: set[str]) -> bool:
        return False

    def ensure_default(self) -> Path:
        from .default import ensure_default_wan_model

        return ensure_default_wan_model()

    def options(self, *, layers: int, latent_upsampler: bool = True, stages: int | None = None,
                distilled: bool = False):
        """Wan 2.1 text-to-video's: a Wan model's options depend on its pipeline (``models.wan.options.WanLayout``),
        which :meth:`describe` reads off the folder."""
        from .options import wan_options

        return wan_options()

    def describe(self, files):
        from .loading import describe_wan
        from .options import wan_options

        geometry, layers, layout = describe_wan(files.folder)
        return geometry, layers, wan_options(layout)

    def load(self, files, *, dtype, device, loaders, offloaded=()):
        from .loading import load_wan

        return load_wan(files, dtype=dtype, device=device, loaders=loaders, offloaded=offloaded)

    def wrap(self, components, *, state):
        from .adapter import WanModel

        return WanModel(components, state=state)

    def component_classes(self, root: Path | None) -> list[tuple[str, Any, bool]]:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import CLIPVisionModel, UMT5EncoderModel

        # transformer_2: Wan 2.2 A14B's low-noise expert; image_encoder: Wan 2.1 I2V's CLIP (where the folder has them).
        return [("transformer", WanTransformer3DModel, False), ("transformer_2", WanTransformer3DModel, False),
                ("vae", AutoencoderKLWan, False), ("text_encoder", UMT5EncoderModel, True),
                ("image_encoder", CLIPVisionModel, True)]

    def lora_spec(self):
        from .adapter import LORA

        return LORA

    def step_passes(self, request) -> set[int]:
        from .adapter import plan_request, step_passes

        return {step_passes(p.request) for p in plan_request(request).passes}


FAMILY = WanFamily()

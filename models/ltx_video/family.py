"""LTX-Video's row of the family table (``models.families``): how its folders are recognised, described, loaded,
placed and wrapped. Light at import time: the diffusers classes are imported inside the methods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.ltx_video import DEFAULT_NAME

__all__ = ["FAMILY", "LTXVideoFamily"]


class LTXVideoFamily:
    name = "ltx-video"
    title = "LTX-Video"
    # The image-to-video and condition pipelines ship the same five components as LTXPipeline, so their folders
    # load the same way.
    pipelines = ("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline")
    transformers = ("LTXVideoTransformer3DModel",)
    upsamplers = ("LTXLatentUpsamplerModel",)
    loader = "load_ltx_video"
    float32_components = ()
    has_audio = False
    vae_tiling = True
    transformer_subfolders = ("transformer",)

    default_name = DEFAULT_NAME
    default_help = f"{DEFAULT_NAME} (the default)"

    # Lightricks' single-file checkpoints (``models.common.single_file``): the diffusers class of each part they hold.
    single_file_classes = {"transformer": "LTXVideoTransformer3DModel", "vae": "AutoencoderKLLTXVideo"}

    def is_single_file_transformer(self, keys: set[str]) -> bool:
        """Whether a single file's (unprefixed) transformer keys are LTX-Video's: the original or diffusers' names,
        and no audio stream (LTX-2's)."""
        if {"audio_patchify_proj.weight", "audio_proj_in.weight"} & keys:
            return False
        diffusers_names = {"proj_in.weight", "caption_projection.linear_1.weight", "scale_shift_table"}
        return "patchify_proj.weight" in keys or diffusers_names <= keys

    def ensure_default(self) -> Path:
        from .default import ensure_default_model

        return ensure_default_model()

    def options(self, *, layers: int, latent_upsampler: bool = True, stages: int | None = None,
                distilled: bool = False):
        from .options import ltx_video_options

        return ltx_video_options(latent_upsampler=latent_upsampler, stages=stages)

    def describe(self, files):
        from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel

        from models.common.describe import geometry_from_configs
        from models.common.loading import recommended_stages

        geometry, layers = geometry_from_configs(files.folder, LTXVideoTransformer3DModel, AutoencoderKLLTXVideo)
        upsampler = files.upsampler is not None
        stages = recommended_stages(files.folder, upsampler=upsampler)
        return geometry, layers, self.options(layers=layers, latent_upsampler=upsampler, stages=stages)

    def load(self, files, *, dtype, device, loaders, offloaded=()):
        from .loading import load_ltx_video

        return load_ltx_video(files, dtype=dtype, device=device, loaders=loaders, offloaded=offloaded)

    def wrap(self, components, *, state):
        from .adapter import LTXVideoModel

        return LTXVideoModel(components, state=state)

    def component_classes(self, root: Path | None) -> list[tuple[str, Any, bool]]:
        from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel
        from diffusers.pipelines.ltx.modeling_latent_upsampler import LTXLatentUpsamplerModel
        from transformers import T5EncoderModel

        return [("transformer", LTXVideoTransformer3DModel, False), ("vae", AutoencoderKLLTXVideo, False),
                ("text_encoder", T5EncoderModel, True), ("latent_upsampler", LTXLatentUpsamplerModel, False)]

    def lora_spec(self):
        from .adapter import LORA

        return LORA

    def step_passes(self, request) -> set[int]:
        from .adapter import plan_request, step_passes

        return {step_passes(p.request) for p in plan_request(request).passes}


FAMILY = LTXVideoFamily()

"""LTX-2's row of the family table (``models.families``): how its folders are recognised, described, loaded,
placed and wrapped. Light at import time: the diffusers classes are imported inside the methods."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.ltx2 import DEFAULT_NAME

__all__ = ["FAMILY", "LTX2Family"]


class LTX2Family:
    name = "ltx2"
    title = "LTX-2"
    pipelines = ("LTX2Pipeline", "LTX2ImageToVideoPipeline")
    transformers = ("LTX2VideoTransformer3DModel",)
    upsamplers = ("LTX2LatentUpsamplerModel",)
    loader = "load_ltx2"
    float32_components = ()
    has_audio = True
    vae_tiling = False
    transformer_subfolders = ("transformer",)

    default_name = DEFAULT_NAME
    default_help = f"{DEFAULT_NAME} (audio + video)"

    # Lightricks' single-file checkpoints (``models.common.single_file``): the diffusers class of each part they hold.
    single_file_classes = {"transformer": "LTX2VideoTransformer3DModel", "vae": "AutoencoderKLLTX2Video",
                           "audio_vae": "AutoencoderKLLTX2Audio"}

    def is_single_file_transformer(self, keys: set[str]) -> bool:
        """Whether a single file's (unprefixed) transformer keys are LTX-2's: it has an audio stream."""
        return bool({"audio_patchify_proj.weight", "audio_proj_in.weight"} & keys)

    def ensure_default(self) -> Path:
        from .default import ensure_default_ltx2_model

        return ensure_default_ltx2_model()

    def options(self, *, layers: int, latent_upsampler: bool = True, stages: int | None = None,
                distilled: bool = False):
        from .options import ltx2_options

        return ltx2_options(layers=layers, latent_upsampler=latent_upsampler, stages=stages, distilled=distilled)

    def describe(self, files):
        from diffusers import AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel

        from models.common.describe import geometry_from_configs
        from models.common.loading import is_distilled, recommended_stages

        geometry, layers = geometry_from_configs(files.folder, LTX2VideoTransformer3DModel, AutoencoderKLLTX2Video)
        upsampler = files.upsampler is not None
        stages = recommended_stages(files.folder, upsampler=upsampler)
        return geometry, layers, self.options(layers=layers, latent_upsampler=upsampler, stages=stages,
                                              distilled=is_distilled(files.folder, checkpoint=files.checkpoint))

    def load(self, files, *, dtype, device, loaders, offloaded=()):
        from .loading import load_ltx2

        return load_ltx2(files, dtype=dtype, device=device, loaders=loaders, offloaded=offloaded)

    def wrap(self, components, *, state):
        from .adapter import LTX2Model

        return LTX2Model(components, state=state)

    def component_classes(self, root: Path | None) -> list[tuple[str, Any, bool]]:
        """The vocoder's class read off ``root``'s config; without a root, the plain one."""
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
        from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
        from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
        from transformers import Gemma3ForConditionalGeneration

        vocoder = LTX2Vocoder
        try:
            if root is not None and json.loads((root / "vocoder" / "config.json").read_text()).get(
                    "_class_name") == "LTX2VocoderWithBWE":
                vocoder = LTX2VocoderWithBWE
        except (OSError, ValueError):
            pass  # the load names the missing or broken file
        return [("transformer", LTX2VideoTransformer3DModel, False), ("vae", AutoencoderKLLTX2Video, False),
                ("audio_vae", AutoencoderKLLTX2Audio, False), ("vocoder", vocoder, False),
                ("connectors", LTX2TextConnectors, False), ("text_encoder", Gemma3ForConditionalGeneration, True),
                ("latent_upsampler", LTX2LatentUpsamplerModel, False)]

    def lora_spec(self):
        from .adapter import LORA

        return LORA

    def step_passes(self, request) -> set[int]:
        from .plan import plan_request, step_passes

        return {step_passes(p.request) for p in plan_request(request).passes}


FAMILY = LTX2Family()

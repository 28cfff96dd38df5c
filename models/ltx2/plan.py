"""LTX-2's requests as plans and guidance settings: LTX2Pipeline's settings for one request
(:class:`LTX2Settings`: the step's passes and cache contexts), and the plan of passes a request runs (one pass, a
window per window, or two stages)."""

from __future__ import annotations

from dataclasses import dataclass

from cp_infer.plan import Plan
from cp_infer.request import GenerationRequest
from cp_infer.step_cache import CacheContext
from models.common.windows import two_stage_window_plan, window_plan, windows_of

from .stages import REFINE_OPTIONS, REFINE_SIGMAS, two_stage_plan

__all__ = ["LTX2Settings", "plan_request", "step_passes"]


@dataclass(frozen=True)
class LTX2Settings:
    """LTX2Pipeline's guidance settings for one request (its defaults where the request leaves them unset)."""

    guidance_scale: float
    audio_guidance_scale: float
    stg_scale: float
    audio_stg_scale: float
    modality_scale: float
    audio_modality_scale: float
    guidance_rescale: float
    audio_guidance_rescale: float
    stg_blocks: tuple[int, ...]

    @classmethod
    def from_request(cls, request: GenerationRequest) -> LTX2Settings:
        """From a resolved request (``models.ltx2.options`` declares the options and their defaults)."""
        o = request.options
        guidance, stg = float(request.guidance_scale), float(o["stg_scale"])
        modality, rescale = float(o["modality_scale"]), float(o["guidance_rescale"])
        # NOTE(pipeline-defaults): LTX2Pipeline treats an audio setting of 0 as "unset" (`audio_x or x`); kept so
        # that equal settings mean equal videos.
        return cls(
            guidance_scale=guidance,
            audio_guidance_scale=float(o["audio_guidance_scale"]) or guidance,
            stg_scale=stg,
            audio_stg_scale=float(o["audio_stg_scale"]) or stg,
            modality_scale=modality,
            audio_modality_scale=float(o["audio_modality_scale"]) or modality,
            guidance_rescale=rescale,
            audio_guidance_rescale=float(o["audio_guidance_rescale"]) or rescale,
            stg_blocks=tuple(o["spatio_temporal_guidance_blocks"]),
        )

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1.0 or self.audio_guidance_scale > 1.0

    @property
    def stg(self) -> bool:
        return self.stg_scale > 0.0 or self.audio_stg_scale > 0.0

    @property
    def modality(self) -> bool:
        return self.modality_scale > 1.0 or self.audio_modality_scale > 1.0

    @property
    def passes(self) -> int:
        """The transformer passes a step runs (``LTX2Model._passes``)."""
        return (2 if self.cfg else 1) + self.stg + self.modality

    @property
    def kinds(self) -> tuple[str, ...]:
        """The step's passes in order: CFG's ``uncond`` and ``cond`` (or ``cond`` alone), ``stg``, ``modality``."""
        prompt = ("uncond", "cond") if self.cfg else ("cond",)
        return prompt + ("stg",) * self.stg + ("modality",) * self.modality

    @property
    def cache_contexts(self) -> tuple[CacheContext, ...]:
        """LTX2Pipeline's cache contexts over the step's passes (``kinds``)."""
        kinds = self.kinds
        prompt = tuple(k for k, kind in enumerate(kinds) if kind in ("uncond", "cond"))
        extra = tuple(CacheContext(_CONTEXTS[kind], (k,)) for k, kind in enumerate(kinds) if kind in _CONTEXTS)
        return (CacheContext("cond_uncond", prompt), *extra)


# The step's passes other than CFG's pair, each in its own cache context (LTX2Pipeline's names).
_CONTEXTS = {"stg": "uncond_stg", "modality": "uncond_modality"}


def plan_request(request: GenerationRequest) -> Plan:
    """One pass (text-to-video, image-to-video or conditions: keyframe tokens in the pass's video stream), or with
    ``stages=2`` the two-stage plan (``models.ltx2.stages``)."""
    windows = windows_of(request)
    if windows is not None:
        if request.options.get("stages", 1) == 2:
            return two_stage_window_plan(request, windows, steps=request.num_inference_steps,
                                         refine_steps=len(REFINE_SIGMAS), refine_options=REFINE_OPTIONS,
                                         num_inference_steps=len(REFINE_SIGMAS), guidance_scale=1.0)
        return window_plan(request, windows, steps=request.num_inference_steps)  # models.ltx2.windows
    if request.options.get("stages", 1) == 2:
        return two_stage_plan(request)
    return Plan.single(request)


def step_passes(request: GenerationRequest) -> int:
    """The transformer passes a step of one of ``request``'s denoising passes runs (CFG's pair, STG, modality)."""
    return LTX2Settings.from_request(request).passes

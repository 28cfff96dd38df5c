"""One entry point from a model folder to a parallelised model, for every supported family.

- :func:`describe_model` reads configs only (no weights; the VAE is built on the meta device to ask diffusers
  its compression), so a front end can check requests before any rank loads anything.
- :func:`open_model` loads the folder's components and wraps them in the family's adapter; with ``compile_blocks``
  it then compiles each transformer block (:func:`compile_transformer_blocks`), after the adapter has installed its
  attention processors, so what is compiled is the parallel block.
The family comes from the folder itself (``detect_family``): the embedded defaults and any local diffusers
folder go through the same path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from cp_infer import ParallelState, VideoGeometry
from cp_infer.options import ModelOptions
from cp_infer.request import GenerationRequest

from ._folder_problems import component_problem, error_line
from .embedded import LATENT_UPSAMPLER
from .geometry import min_latent_side
from .loading import ModelLoadError, detect_family, is_distilled, parse_dtype, recommended_stages, resolve_model

__all__ = ["ModelInfo", "compile_transformer_blocks", "describe_model", "model_options",
           "open_model"]


@dataclass(frozen=True)
class ModelInfo:
    """What the front end needs to know about a model folder before loading it."""

    path: Path
    family: str
    """``ltx-video`` or ``ltx2``."""
    geometry: VideoGeometry
    layers: int
    """Transformer blocks."""
    options: ModelOptions
    """The request options the model declares (its adapter's, with its reference pipeline's defaults)."""

    @property
    def has_audio(self) -> bool:
        return self.family == "ltx2"

    def step_passes(self, request: GenerationRequest) -> set[int]:
        """How many transformer passes a step runs, over the denoising passes of ``request``'s plan (a resolved
        request; the plan is the adapter's own, so a second stage's own guidance counts)."""
        if self.family == "ltx-video":
            from .ltx_video import plan_request, step_passes
        else:
            from .ltx2 import plan_request, step_passes
        return {step_passes(p.request) for p in plan_request(request).passes}


def model_options(family: str, *, layers: int, latent_upsampler: bool = True,
                  stages: int | None = None, distilled: bool = False) -> ModelOptions:
    """The request options of a ``family`` model with ``layers`` transformer blocks, with or without a
    ``latent_upsampler`` (two-stage generation), whose requests get ``stages`` by default (unset: what a folder with
    or without an upsampler is recommended); ``distilled`` (LTX-2): a distilled checkpoint's defaults."""
    if family == "ltx-video":
        from .ltx_video_options import ltx_video_options

        return ltx_video_options(latent_upsampler=latent_upsampler, stages=stages)
    from .ltx2_options import ltx2_options

    return ltx2_options(layers=layers, latent_upsampler=latent_upsampler, stages=stages, distilled=distilled)


def _classes(family: str):
    if family == "ltx-video":
        from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel

        return LTXVideoTransformer3DModel, AutoencoderKLLTXVideo
    from diffusers import AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel

    return LTX2VideoTransformer3DModel, AutoencoderKLLTX2Video


def describe_model(model: str | os.PathLike | None) -> ModelInfo:
    """Family and video geometry of ``model`` (a folder, or an embedded default's name, or None)."""
    path = resolve_model(model)
    family = detect_family(path)
    transformer_cls, vae_cls = _classes(family)
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
    layers = int(transformer.get("num_layers", 0))
    stages = recommended_stages(path)
    upsampler = (path / LATENT_UPSAMPLER).is_dir()
    return ModelInfo(path=path, family=family, geometry=geometry, layers=layers,
                     options=model_options(family, layers=layers, latent_upsampler=upsampler, stages=stages,
                                           distilled=is_distilled(path)))


_RECOMPILE_LIMIT = 64


def compile_transformer_blocks(transformer: torch.nn.Module) -> None:
    """``torch.compile`` each transformer block in place (regional compilation: diffusers'
    ``compile_repeated_blocks``; the blocks share one compiled graph, so compiling costs about one block's time).

    NOTE(compile-collectives): dynamo traces through the Ulysses processors, all-to-alls included: it rewrites
    ``dist.all_to_all_single`` into the functional collective, so a block is one graph with its two exchanges per
    attention inside it (no graph break; gloo and NCCL alike).
    NOTE(compile-shapes): a block is compiled on its first call of each request shape: the shard plans' lengths are
    plain ints on the processors' context, which dynamo specialises on, so dynamic shapes would not spare the
    recompile of a new shape and would only make every graph slower. Static graphs (``dynamic=False``) then; the
    inductor cache makes a shape compiled before, in this process or an earlier one, cheap.
    NOTE(recompile-limit): a block is also compiled once per kind of call: LTX-2's blocks see batch 2 (CFG's pair)
    and batch 1 (the guidance passes), each cross-modal attention on and off (modality isolation), the perturbed
    block of spatio-temporal guidance. Shapes times kinds pass dynamo's default of 8 graphs per function, past which
    it silently runs the block eagerly, so the limit is raised (process-wide) to 64.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    transformer.compile_repeated_blocks(dynamic=False)


def open_model(model: str | os.PathLike | None, *, dtype: str | torch.dtype, state: ParallelState,
               compile_blocks: bool = False):
    """Load ``model`` on ``state.device`` and return its parallel adapter (``LTXVideoModel`` or ``LTX2Model``);
    ``compile_blocks``: :func:`compile_transformer_blocks` on its transformer."""
    path = resolve_model(model)
    family = detect_family(path)
    dtype = parse_dtype(dtype)
    if family == "ltx-video":
        from .loading import load_ltx_video
        from .ltx_video import LTXVideoModel

        adapter = LTXVideoModel(load_ltx_video(path, dtype=dtype, device=state.device), state=state)
    else:
        from .loading import load_ltx2
        from .ltx2 import LTX2Model

        adapter = LTX2Model(load_ltx2(path, dtype=dtype, device=state.device), state=state)
    if compile_blocks:
        compile_transformer_blocks(adapter.transformer)
    return adapter

"""One entry point from a model folder to a parallelised model, for every supported family.

- :func:`describe_model` reads configs only (no weights; the VAE is built on the meta device to ask diffusers
  its compression), so a front end can check requests before any rank loads anything.
- :func:`open_model` loads the folder's components where ``weights`` and ``offload`` put them (``models.placement``:
  the transformer and text encoder sharded over the replica group, read a shard per rank, or replicated) and wraps
  them in the family's adapter; with ``compile_blocks``
  it then compiles each transformer block (:func:`compile_transformer_blocks`), after the adapter has installed its
  attention processors, so what is compiled is the parallel block.
The family comes from the folder itself (``detect_family``): the embedded defaults, any local diffusers folder, a
hub snapshot and a single file's config folder go through the same path (``models.loading.resolve_files``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cp_infer import ParallelState, VideoGeometry
from cp_infer.options import ModelOptions
from cp_infer.request import GenerationRequest

from ._folder_problems import component_problem, error_line
from .geometry import min_latent_side
from .loading import (
    ModelFiles,
    ModelLoadError,
    detect_family,
    is_distilled,
    parse_dtype,
    recommended_stages,
    resolve_files,
)

__all__ = ["ModelInfo", "compile_transformer_blocks", "describe_model", "lora_catalog", "lora_spec", "model_options",
           "open_model"]


@dataclass(frozen=True)
class ModelInfo:
    """What the front end needs to know about a model folder before loading it."""

    path: Path
    family: str
    """``ltx-video``, ``ltx2`` or ``wan``."""
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
        elif self.family == "wan":
            from .wan import plan_request, step_passes
        else:
            from .ltx2 import plan_request, step_passes
        return {step_passes(p.request) for p in plan_request(request).passes}


def model_options(family: str, *, layers: int, latent_upsampler: bool = True,
                  stages: int | None = None, distilled: bool = False) -> ModelOptions:
    """The request options of a ``family`` model with ``layers`` transformer blocks, with or without a
    ``latent_upsampler`` (two-stage generation), whose requests get ``stages`` by default (unset: what a folder with
    or without an upsampler is recommended); ``distilled`` (LTX-2): a distilled checkpoint's defaults. A Wan model's
    options depend on its pipeline (``models.wan_options.WanLayout``): these are Wan 2.1 text-to-video's."""
    if family == "wan":
        from .wan_options import wan_options

        return wan_options()
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


def describe_model(model: str | os.PathLike | ModelFiles | None, *, config: str | os.PathLike | None = None,
                   upsampler: str | os.PathLike | None = None) -> ModelInfo:
    """Family and video geometry of ``model`` (a folder, a hub id, an embedded default's name or None, or a single
    file with its ``config``; with a paired ``upsampler``: ``models.loading.resolve_files``). A hub repo's configs
    alone are fetched for it."""
    files = resolve_files(model, config=config, upsampler=upsampler, weights=False)
    path = files.folder
    family = detect_family(path)
    if family == "wan":
        from .wan_loading import describe_wan
        from .wan_options import wan_options

        geometry, layers, layout = describe_wan(path)
        return ModelInfo(path=path, family=family, geometry=geometry, layers=layers, options=wan_options(layout))
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
    upsampler = files.upsampler is not None
    stages = recommended_stages(path, upsampler=upsampler)
    return ModelInfo(path=path, family=family, geometry=geometry, layers=layers,
                     options=model_options(family, layers=layers, latent_upsampler=upsampler, stages=stages,
                                           distilled=is_distilled(path, checkpoint=files.checkpoint)))


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
    from cp_infer.weights import sharded_weights

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
    if sharded_weights(transformer) is not None:
        # NOTE(compile-fsdp): fully_shard renames a block's class (FSDP<name>), by which compile_repeated_blocks finds
        # the blocks: the same blocks compiled one by one, FSDP2's hooks left outside the graph (dynamo skips them).
        for block in transformer.transformer_blocks:
            block.compile(dynamic=False)
        return
    transformer.compile_repeated_blocks(dynamic=False)


def lora_spec(family: str):
    """How a ``family`` model's adapters load (``models.lora.LoraSpec``, declared beside its adapter)."""
    if family == "ltx-video":
        from .ltx_video import LORA
    elif family == "wan":
        from .wan import LORA
    else:
        from .ltx2 import LORA
    return LORA


def lora_catalog(info: ModelInfo, lora_dir: str | os.PathLike | None, *, slot_rank: int | None = None):
    """What a front end checks requests' ``loras`` against (``models.lora.LoraCatalog``): the adapters of
    ``lora_dir`` (``None``: none) and the modules of ``info``'s model, built on the meta device from its configs on
    first use; ``slot_rank``: the model is compiled with adapter slots of that rank (``open_model``'s
    ``max_lora_rank``), which an adapter must fit too."""
    from .lora import LoraCatalog, LoraDirectory, targets_from_configs

    spec = lora_spec(info.family)
    directory = None if lora_dir is None else LoraDirectory(lora_dir)
    return LoraCatalog(directory, spec=spec, targets=lambda: targets_from_configs(info.path, spec),
                       slot_rank=slot_rank)


def open_model(model: str | os.PathLike | ModelFiles | None, *, dtype: str | torch.dtype, state: ParallelState,
               config: str | os.PathLike | None = None, upsampler: str | os.PathLike | None = None,
               compile_blocks: bool = False, lora_dir: str | os.PathLike | None = None,
               max_lora_bytes: int | None = None, weights: str = "auto", offload: Sequence[str] = (),
               stage_2_loras: Sequence = (), max_lora_rank: int | None = None):
    """Load ``model`` (with ``config`` and ``upsampler`` as :func:`describe_model` takes them) on ``state.device`` and
    return its parallel adapter (``LTXVideoModel``, ``LTX2Model`` or ``WanModel``); ``compile_blocks``:
    :func:`compile_transformer_blocks` on its transformer; ``lora_dir``: the adapters requests may apply
    (``models.lora.LoadedLoras``, keeping at most ``max_lora_bytes`` of them loaded; unset: the default), and
    ``stage_2_loras`` those stage 2 of two-stage generation adds (``models.lora.pass_loras``); with both
    ``compile_blocks`` and ``lora_dir`` the adapters are copied into slots of rank ``max_lora_rank`` (unset: the
    default) made before the compile (``models.lora_slots``), so the blocks compile once for every adapter;
    ``weights`` and ``offload``: where the components go (``models.placement``; the adapter's ``placement``)."""
    from .placement import apply_offload, offloaded_components, resolve_placement, sharded_loaders

    files = resolve_files(model, config=config, upsampler=upsampler)
    family = detect_family(files.folder)
    dtype = parse_dtype(dtype)
    placement = resolve_placement(files.folder, dtype=dtype, state=state, weights=weights, offload=offload)
    loaders = sharded_loaders(family, placement)
    offloaded = offloaded_components(placement)
    if family == "wan":
        from .wan import WanModel
        from .wan_loading import load_wan

        adapter = WanModel(load_wan(files, dtype=dtype, device=state.device, loaders=loaders, offloaded=offloaded),
                           state=state)
    elif family == "ltx-video":
        from .loading import load_ltx_video
        from .ltx_video import LTXVideoModel

        adapter = LTXVideoModel(load_ltx_video(files, dtype=dtype, device=state.device, loaders=loaders,
                                               offloaded=offloaded), state=state)
    else:
        from .loading import load_ltx2
        from .ltx2 import LTX2Model

        adapter = LTX2Model(load_ltx2(files, dtype=dtype, device=state.device, loaders=loaders, offloaded=offloaded),
                            state=state)
    apply_offload(adapter.components, placement)
    adapter.placement = placement
    if lora_dir is not None:
        from .lora import DEFAULT_MAX_LORA_BYTES, LoadedLoras, LoraDirectory, adapted_modules

        directory, slots = LoraDirectory(lora_dir), None
        if compile_blocks:
            from .lora_slots import DEFAULT_MAX_LORA_RANK, make_slots

            slots = make_slots(adapter.lora_parts(), adapted_modules(directory, adapter.lora_spec),
                               rank=DEFAULT_MAX_LORA_RANK if max_lora_rank is None else max_lora_rank)
        adapter.loras = LoadedLoras(directory, spec=adapter.lora_spec, parts=adapter.lora_parts(),
                                    max_bytes=DEFAULT_MAX_LORA_BYTES if max_lora_bytes is None else max_lora_bytes,
                                    stage_2=stage_2_loras, slots=slots)
    if compile_blocks:
        # Wan 2.2 A14B runs two experts (``WanModel.experts``); every other model one transformer.
        for transformer in getattr(adapter, "experts", (adapter.transformer,)):
            compile_transformer_blocks(transformer)
    return adapter

"""One entry point from a model folder to a parallelised model, for every family of ``models.families``.

- :func:`describe_model` reads configs only (no weights; the VAE is built on the meta device to ask diffusers
  its compression), so a front end can check requests before any rank loads anything.
- :func:`open_model` loads the folder's components where ``weights`` and ``offload`` put them
  (``models.common.placement``:
  the transformer and text encoder sharded over the replica group, read a shard per rank, or replicated) and wraps
  them in the family's adapter; with ``compile_blocks``
  it then compiles each transformer block (:func:`compile_transformer_blocks`), after the adapter has installed its
  attention processors, so what is compiled is the parallel block.
The family comes from the folder itself (``detect_family``): the embedded defaults, any local diffusers folder, a
hub snapshot and a single file's config folder go through the same path (``models.common.loading.resolve_files``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cp_infer import ParallelState, VideoGeometry
from cp_infer.options import ModelOptions
from cp_infer.request import GenerationRequest
from models.common.loading import ModelFiles, detect_family, parse_dtype, resolve_files
from models.families import DEFAULT_FAMILY, family

__all__ = ["ModelInfo", "compile_transformer_blocks", "default_model_options", "describe_model", "lora_catalog",
           "lora_spec", "model_options", "open_model"]


@dataclass(frozen=True)
class ModelInfo:
    """What the front end needs to know about a model folder before loading it."""

    path: Path
    family: str
    """Its family's name in ``models.families.FAMILIES``."""
    geometry: VideoGeometry
    layers: int
    """Transformer blocks."""
    options: ModelOptions
    """The request options the model declares (its adapter's, with its reference pipeline's defaults)."""

    @property
    def has_audio(self) -> bool:
        return family(self.family).has_audio

    @property
    def attention_heads(self) -> int:
        """The heads every sharded attention of the transformer divides into: the greatest common divisor of its
        config's head counts (``num_attention_heads``, and an audio stream's ``audio_num_attention_heads``), read from
        ``transformer/config.json``; what ``--ring-degree auto`` keeps the Ulysses degree a divisor of."""
        config = json.loads((Path(self.path) / "transformer" / "config.json").read_text())
        counts = [int(config[k]) for k in ("num_attention_heads", "audio_num_attention_heads") if k in config]
        if not counts:
            raise ValueError(f"{self.path}/transformer/config.json names no num_attention_heads")
        return math.gcd(*counts)

    def step_passes(self, request: GenerationRequest) -> set[int]:
        """How many transformer passes a step runs, over the denoising passes of ``request``'s plan (a resolved
        request; the plan is the adapter's own, so a second stage's own guidance counts)."""
        return family(self.family).step_passes(request)


def model_options(family_name: str, *, layers: int, latent_upsampler: bool = True,
                  stages: int | None = None, distilled: bool = False) -> ModelOptions:
    """The request options of a ``family_name`` model with ``layers`` transformer blocks, with or without a
    ``latent_upsampler`` (two-stage generation), whose requests get ``stages`` by default (unset: what a folder with
    or without an upsampler is recommended); ``distilled`` (LTX-2): a distilled checkpoint's defaults. A Wan model's
    options depend on its pipeline (``models.wan.options.WanLayout``): these are Wan 2.1 text-to-video's."""
    return family(family_name).options(layers=layers, latent_upsampler=latent_upsampler, stages=stages,
                                       distilled=distilled)


def default_model_options() -> ModelOptions:
    """The options of the model served when none is named (``models.families.DEFAULT_FAMILY``'s), at one block and
    one stage: what the CLI shows before it knows the model."""
    return model_options(DEFAULT_FAMILY, layers=1, stages=1)


def describe_model(model: str | os.PathLike | ModelFiles | None, *, config: str | os.PathLike | None = None,
                   upsampler: str | os.PathLike | None = None) -> ModelInfo:
    """Family and video geometry of ``model`` (a folder, a hub id, an embedded default's name or None, or a single
    file with its ``config``; with a paired ``upsampler``: ``models.common.loading.resolve_files``). A hub repo's
    configs
    alone are fetched for it."""
    files = resolve_files(model, config=config, upsampler=upsampler, weights=False)
    name = detect_family(files.folder)
    geometry, layers, options = family(name).describe(files)
    return ModelInfo(path=files.folder, family=name, geometry=geometry, layers=layers, options=options)


_RECOMPILE_LIMIT = 64


def compile_transformer_blocks(transformer: torch.nn.Module) -> None:
    """``torch.compile`` each transformer block in place (regional compilation: diffusers'
    ``compile_repeated_blocks``; the blocks share one compiled graph, so compiling costs about one block's time).

    NOTE(compile-collectives): dynamo traces through the Ulysses processors, all-to-alls included: it rewrites
    ``dist.all_to_all_single`` into the functional collective, so a block is one graph with its two exchanges per
    attention inside it (no graph break; gloo and NCCL alike). With a ring (``--ring-degree``) the ring's steps run
    eagerly between two graphs (``cp_infer.ring.ring_attention`` is ``torch.compiler.disable``d: point-to-point
    sends do not trace), one graph break per self-attention.
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


def lora_spec(family_name: str):
    """How a ``family_name`` model's adapters load (``models.common.lora.LoraSpec``, declared beside its adapter)."""
    return family(family_name).lora_spec()


def lora_catalog(info: ModelInfo, lora_dir: str | os.PathLike | None, *, slot_rank: int | None = None):
    """What a front end checks requests' ``loras`` against (``models.common.lora.LoraCatalog``): the adapters of
    ``lora_dir`` (``None``: none) and the modules of ``info``'s model, built on the meta device from its configs on
    first use; ``slot_rank``: the model is compiled with adapter slots of that rank (``open_model``'s
    ``max_lora_rank``), which an adapter must fit too."""
    from models.common.lora import LoraCatalog, LoraDirectory, targets_from_configs

    spec = lora_spec(info.family)
    directory = None if lora_dir is None else LoraDirectory(lora_dir)
    return LoraCatalog(directory, spec=spec, targets=lambda: targets_from_configs(info.path, spec),
                       slot_rank=slot_rank)


def check_vae_tiling(name: str, vae_tiling: bool) -> None:
    """``--vae-tiling`` for a model of family ``name``: a ``ValueError`` naming it where the family has no tiled VAE."""
    chosen = family(name)
    if vae_tiling and not chosen.vae_tiling:
        raise ValueError(f"--vae-tiling: {chosen.title} models decode without diffusers' spatial tiles (their "
                         "streamed decode bounds the memory); leave it out")


def open_model(model: str | os.PathLike | ModelFiles | None, *, dtype: str | torch.dtype, state: ParallelState,
               config: str | os.PathLike | None = None, upsampler: str | os.PathLike | None = None,
               compile_blocks: bool = False, lora_dir: str | os.PathLike | None = None,
               max_lora_bytes: int | None = None, weights: str = "auto", offload: Sequence[str] = (),
               stage_2_loras: Sequence = (), max_lora_rank: int | None = None, vae_tiling: bool = False):
    """Load ``model`` (with ``config`` and ``upsampler`` as :func:`describe_model` takes them) on ``state.device`` and
    return its parallel adapter (``LTXVideoModel``, ``LTX2Model`` or ``WanModel``); ``compile_blocks``:
    :func:`compile_transformer_blocks` on its transformer; ``lora_dir``: the adapters requests may apply
    (``models.common.lora.LoadedLoras``, keeping at most ``max_lora_bytes`` of them loaded; unset: the default), and
    ``stage_2_loras`` those stage 2 of two-stage generation adds (``models.common.lora.pass_loras``); with both
    ``compile_blocks`` and ``lora_dir`` the adapters are copied into slots of rank ``max_lora_rank`` (unset: the
    default) made before the compile (``models.common.lora_slots``), so the blocks compile once for every adapter;
    ``weights`` and ``offload``: where the components go (``models.common.placement``; the adapter's ``placement``);
    ``vae_tiling``: its VAE in diffusers' spatial tiles (a family whose ``vae_tiling`` is false refuses it)."""
    from models.common.placement import apply_offload, offloaded_components, resolve_placement, sharded_loaders

    files = resolve_files(model, config=config, upsampler=upsampler)
    name = detect_family(files.folder)
    dtype = parse_dtype(dtype)
    chosen = family(name)
    check_vae_tiling(name, vae_tiling)
    placement = resolve_placement(files.folder, dtype=dtype, state=state, weights=weights, offload=offload)
    loaders = sharded_loaders(name, placement)
    offloaded = offloaded_components(placement)
    components = chosen.load(files, dtype=dtype, device=state.device, loaders=loaders, offloaded=offloaded)
    adapter = chosen.wrap(components, state=state)
    apply_offload(adapter.components, placement)
    adapter.placement = placement
    if vae_tiling:
        adapter.enable_vae_tiling()
    if lora_dir is not None:
        from models.common.lora import DEFAULT_MAX_LORA_BYTES, LoadedLoras, LoraDirectory, adapted_modules

        directory, slots = LoraDirectory(lora_dir), None
        if compile_blocks:
            from models.common.lora_slots import DEFAULT_MAX_LORA_RANK, make_slots

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

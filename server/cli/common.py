"""What ``cp-infer generate`` and ``cp-infer batch`` share: their arguments and the checks that run before any process
group forms (the leader's side of a run is ``server.cli.lead``; conditioning media, ``server.cli.media_args``).

Invariants:
- The generation flags are derived from the loaded model's declared options (``cp_infer.options``): ``--name``
  for ``name`` plus the option's short flags; a request error names the flag the user typed (:func:`field_error`).
- The model is described from its config files alone (:func:`model_info`: family and geometry, no weights), so a
  bad request is refused, with exit code 2, before any rank loads anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cp_infer.decode import AUTO, DEFAULT_FRAMES_PER_RANK
from cp_infer.devices import AUTO as AUTO_DTYPE
from cp_infer.devices import DTYPES
from cp_infer.options import ModelOptions, Option
from cp_infer.placement import OFFLOAD_COMPONENTS, WEIGHTS_MODES, parse_offload
from cp_infer.request import LORA_SCALE, MAX_LORAS, GenerationLimits, GenerationRequest, LoraWeight
from models.common.lora import DEFAULT_MAX_LORA_BYTES
from models.common.lora_slots import DEFAULT_MAX_LORA_RANK
from models.families import defaults_text, titles_text
from server.outputs.piece_video import WriteError

if TYPE_CHECKING:
    pass

__all__ = [
    "PROG",
    "USAGE_ERROR",
    "UsageError",
    "WriteError",
    "add_media_arguments",
    "add_placement_arguments",
    "add_request_arguments",
    "add_runtime_arguments",
    "check_device",
    "check_layout",
    "fetch_model",
    "field_error",
    "check_request_loras",
    "check_stage_2_loras",
    "check_vae_tiling",
    "lora_catalog",
    "model_info",
    "option_keys",
    "options_for",
    "parse_condition",
    "parse_lora",
    "quiet_libraries",
    "request_from_args",
    "runtime_config_from_args",
]

log = logging.getLogger("cp_infer.cli")

PROG = "cp-infer"
USAGE_ERROR = 2
class UsageError(ValueError):
    """A bad argument, request or file: reported in one line, exit code 2, nothing started."""


# ------------------------------------------------------------------------------------------------- arguments


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every rank needs to load the same model the same way (shared with ``serve``)."""
    group = parser.add_argument_group("model and parallelism")
    group.add_argument("--model", default=None, help=f"a diffusers-format {titles_text()} folder, a Hugging "
                                                    "Face hub id ORG/NAME[@REVISION] (fetched into the hub cache: "
                                                    "HF_HOME, HF_HUB_OFFLINE, HF_TOKEN), a single-file .safetensors "
                                                    "checkpoint (with --config), or an embedded default: "
                                                    f"{defaults_text()}")
    group.add_argument("--config", dest="model_config", default=None, metavar="ORG/NAME|DIR",
                       help="for a single-file --model: the diffusers folder or hub id its configs, scheduler, text "
                            "encoder, tokenizer (and LTX-2's connectors and vocoder) come from")
    group.add_argument("--upsampler", default=None, metavar="ORG/NAME|DIR",
                       help="a latent upsampler to pair with the model for two-stage generation (its config.json "
                            "and weights at the root or in latent_upsampler/, e.g. "
                            "Lightricks/ltxv-spatial-upscaler-0.9.7; default: the model folder's latent_upsampler/)")
    group.add_argument("--dtype", default=AUTO_DTYPE, choices=DTYPES,
                       help="the weights' and activations' dtype (auto, the default: bf16 on CUDA, with TF32 for what "
                            "stays float32; fp32 on the CPU). Wan's VAE and image encoder stay fp32, as in diffusers' "
                            "Wan examples")
    group.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda when available")
    group.add_argument("--decode-frames-per-rank", type=_frames_per_rank, default=DEFAULT_FRAMES_PER_RANK, metavar="K",
                       help="latent frames (8 video frames each for LTX, 4 for Wan and Helios, whose decode cuts "
                            "each chunk) per decoded piece: decode memory and the time to "
                            "the first streamed frame grow with K, and so do the convolutions "
                            f"(default {DEFAULT_FRAMES_PER_RANK}: 4 at 128x96, 2 from 192x128 up; 'all': the whole "
                            "video at once)")
    group.add_argument("--vae-tiling", action="store_true",
                       help="decode (and encode media) in diffusers' spatial tiles above 512 px, as "
                            "vae.enable_tiling(): less VAE memory at large frames, and the video of the pipeline "
                            "with tiling on instead of its default (models whose VAE tiles: LTX-Video)")
    group.add_argument("--nproc", type=int, default=None, metavar="N",
                       help="ranks of the parallel group; N > 1 relaunches under torchrun (default 1, "
                            "or the torchrun world size)")
    group.add_argument("--guidance-degree", type=int, default=None, metavar="G",
                       help="ranks a step's guidance passes (CFG's conditional and unconditional, STG, modality) are "
                            "spread over, exchanging their predictions once per step (default, with no "
                            "--ulysses-degree either: `generate` and `batch` take the most that divide both the "
                            "ranks and every step's pass count, e.g. 2 for CFG on an even count; `serve` 1)")
    group.add_argument("--ulysses-degree", type=int, default=None, metavar="U",
                       help="ranks each pass's token sequence is sharded over (Ulysses: two all-to-alls per "
                            "attention layer, each rank attending its share of the heads); G x R x U must divide the "
                            "ranks, and `serve` runs ranks / (G x R x U) replica groups, each its own jobs (default: "
                            "ranks / (G x R))")
    group.add_argument("--ring-degree", type=_ring_degree, default=None, metavar="R|auto",
                       help="Ulysses groups each pass's token sequence is sharded over, passing key/value blocks "
                            "round a ring (R - 1 point-to-point steps per attention layer, each overlapped with a "
                            "block's attention): the ranks may then exceed the heads with no padded head, and across "
                            "nodes only the ring crosses the slow link (Ulysses groups are consecutive ranks, rings "
                            "stride over them). --nproc 2 --ring-degree 2 is a ring of two, --nproc 4 --ring-degree 2 "
                            "Ulysses 2 x ring 2; auto: over the ranks / G, Ulysses up to the ranks of a node "
                            "(LOCAL_WORLD_SIZE) and a divisor of the model's heads, the ring for the rest (default 1)")
    group.add_argument("--compile", dest="compile_blocks", action="store_true",
                       help="torch.compile each transformer block (regional compilation; the Ulysses all-to-alls "
                            "compile inside the blocks): the first request of a shape pays the compile, later "
                            "steps run faster (default off)")
    add_placement_arguments(group)
    group.add_argument("--lora-dir", default=None, metavar="DIR",
                       help="a folder of LoRA adapters, each NAME.safetensors (diffusers', Lightricks' or ComfyUI's "
                            "keys), that requests may apply by NAME (--lora, or a request's loras; default: none)")
    group.add_argument("--max-lora-bytes", type=_byte_count, default=DEFAULT_MAX_LORA_BYTES, metavar="BYTES",
                       help="adapter tensors each rank keeps loaded between jobs, least recently used dropped first "
                            f"(a number, or with K, M, G; default {DEFAULT_MAX_LORA_BYTES // 2**30}G)")
    group.add_argument("--max-lora-rank", type=int, default=DEFAULT_MAX_LORA_RANK, metavar="R",
                       help="with --compile: the rank of the adapter slots the compiled blocks hold, the highest "
                            "adapter rank that applies without recompiling (default "
                            f"{DEFAULT_MAX_LORA_RANK})")
    group.add_argument("--stage-2-lora", dest="stage_2_loras", action="append", default=None, type=_lora_arg,
                       metavar="NAME[:SCALE]", help="an adapter of --lora-dir that stage 2 of two-stage generation "
                       "(stages=2) applies after a request's own, with SCALE (default 1): Lightricks' distilled LoRA "
                       "in the dev two-stage recipe; repeatable")


def add_placement_arguments(group) -> None:
    """``--weights`` and ``--offload``: where the components' weights go (``models.common.placement``; also
    ``cp-infer memory``'s)."""
    group.add_argument("--weights", default="auto", choices=WEIGHTS_MODES,
                       help="sharded: the transformer and the text encoder 1/N on each of a replica group's N ranks "
                            "(FSDP2 per block, each rank reading only its shard; gathered a block at a time, the next "
                            "one prefetched), replicated: whole on every rank; auto (default): sharded where the "
                            "replicated weights would not fit the GPU's free memory, replicated on the CPU")
    group.add_argument("--offload", type=_offload_arg, default=(), metavar="COMPONENT[,COMPONENT...]",
                       help=f"components kept on the CPU between uses ({', '.join(OFFLOAD_COMPONENTS)}; pinned "
                            "memory on CUDA), transformer blocks streamed in one ahead (default: none)")


def _offload_arg(text: str) -> tuple[str, ...]:
    try:
        return parse_offload(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ring_degree(text: str) -> int | str:
    if text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a ring degree: give a number of ranks or 'auto'") from None


def resolve_auto_ring(args: argparse.Namespace) -> None:
    """``--ring-degree auto`` made numbers: ``args.ulysses_degree`` and ``args.ring_degree`` from the model's heads
    (its config files), the ranks over the guidance degree and the ranks of a node (``LOCAL_WORLD_SIZE``; before
    torchrun, the ranks this launcher starts), by ``cp_infer.mesh.auto_ring``. Every rank resolves it alike."""
    if args.ring_degree != AUTO:
        return
    from cp_infer.mesh import auto_ring
    from models.registry import describe_model
    from server.cli.launch import group_size

    if args.ulysses_degree is not None:
        raise ValueError(f"--ring-degree auto picks the Ulysses degree too; give --ring-degree R with "
                         f"--ulysses-degree {args.ulysses_degree}, or leave --ulysses-degree out")
    world = group_size(args.nproc)
    guidance = args.guidance_degree or 1
    if world % guidance:
        raise ValueError(f"--guidance-degree {guidance} does not divide the {world} ranks; give a divisor of {world}")
    heads = describe_model(args.model, config=args.model_config, upsampler=args.upsampler).attention_heads
    node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    args.ulysses_degree, args.ring_degree = auto_ring(world // guidance, heads, node)


def check_layout(args: argparse.Namespace, *, replicas: bool = False) -> None:
    """Refuse a mesh layout that does not make the group (``--guidance-degree`` x ``--ring-degree`` x
    ``--ulysses-degree`` against the ranks), before anything starts; the message lists the valid ones. ``replicas``:
    whether the command runs jobs on replica groups (``serve``, ``batch``); elsewhere a layout that leaves more than
    one is refused too. ``--ring-degree auto`` is resolved here first (:func:`resolve_auto_ring`)."""
    from cp_infer.mesh import MeshLayout, valid_layouts
    from server.cli.launch import group_size

    resolve_auto_ring(args)
    layout = MeshLayout.resolve(group_size(args.nproc), guidance_degree=args.guidance_degree,
                                ulysses_degree=args.ulysses_degree, ring_degree=args.ring_degree)
    if layout.replicas > 1 and not replicas:
        ring = f"--ring-degree {layout.ring} " if layout.ring > 1 else ""
        whole = ", ".join(f"--guidance-degree {g} {ring}--ulysses-degree {u}"
                          for g, u in valid_layouts(layout.world // layout.ring)
                          if g * u * layout.ring == layout.world)
        ring = f" x ring_degree={layout.ring}" if layout.ring > 1 else ""
        raise ValueError(f"guidance_degree={layout.guidance}{ring} x ulysses_degree={layout.ulysses} on "
                         f"{layout.world} ranks makes {layout.replicas} replica groups, and this command does not run "
                         f"jobs on replicas (`cp-infer serve` and `batch` do); valid layouts here: {whole}")


def guidance_first(config, args: argparse.Namespace, info, requests: Sequence[GenerationRequest]):
    """``config`` with the guidance-first layout (``cp_infer.mesh.MeshLayout.guidance_first``) for the ``requests``
    the command will run (resolved, on model ``info``), when neither ``--guidance-degree`` nor ``--ulysses-degree``
    was given (a ``--ring-degree`` R keeps its ring: the guidance-first layout of the ranks / R Ulysses groups); else
    ``config`` itself. Deterministic: every rank that has the requests picks the same layout."""
    from cp_infer.mesh import MeshLayout
    from server.cli.launch import group_size

    if args.guidance_degree is not None or args.ulysses_degree is not None:
        return config
    passes = set().union(*(info.step_passes(r) for r in requests))
    ring = args.ring_degree or 1
    layout = MeshLayout.guidance_first(group_size(args.nproc) // ring, passes)
    return replace(config, guidance_degree=layout.guidance, ulysses_degree=layout.ulysses)


def runtime_config_from_args(args: argparse.Namespace, *, replicas: bool = False):
    """``replicas``: whether the command runs jobs on replica groups (``check_layout``)."""
    from server.group.runtime import RuntimeConfig

    check_layout(args, replicas=replicas)
    return RuntimeConfig(model=args.model, model_config=args.model_config, upsampler=args.upsampler,
                         dtype=args.dtype, device=args.device,
                         decode_frames_per_rank=args.decode_frames_per_rank, vae_tiling=args.vae_tiling,
                         guidance_degree=args.guidance_degree,
                         ulysses_degree=args.ulysses_degree, ring_degree=args.ring_degree,
                         compile_blocks=args.compile_blocks,
                         lora_dir=args.lora_dir, max_lora_bytes=args.max_lora_bytes,
                         max_lora_rank=args.max_lora_rank,
                         stage_2_loras=tuple(args.stage_2_loras or ()), weights=args.weights, offload=args.offload)


def _frames_per_rank(text: str) -> int | str | None:
    if text == "all":
        return None
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1, 'auto' or 'all'")
    return value


def _flags(option: Option) -> list[str]:
    return list(dict.fromkeys([option.flag, *option.flags]))


def option_keys(options: ModelOptions) -> dict[str, str]:
    """Every name a prompts file's key may use for an option (its name, aliases and flags without dashes) -> the
    option's name."""
    keys = {}
    for option in options:
        for key in (option.name, *option.aliases, *(f[2:].replace("-", "_") for f in option.flags)):
            keys[key] = option.name
    return keys


def _option_type(option: Option):
    if option.kind is tuple:
        return _block_list if option.item is int else _number_list
    if option.kind is list:
        return _json_list
    return option.kind


def _json_list(text: str) -> list[Any]:
    """``--prompt-segments '[{"start_window": 0, "text": "..."}]'``."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): give a JSON list of objects") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError("give a JSON list of objects")
    return value


def _default_text(option: Option) -> str:
    default = option.default
    if default is None:
        return "unset"
    return ",".join(map(str, default)) if isinstance(default, tuple) else repr(default)


def _limit_text(option: Option) -> str:
    """The deployment limit's note for a flag's help (``generate`` and ``batch`` run under the default limits)."""
    note = option.limit_note(GenerationLimits())
    return f"; {note}" if note else ""


def add_request_arguments(parser: argparse.ArgumentParser, options: ModelOptions, *, batch: bool) -> None:
    """The generation options the model declares (``options``), each ``--name`` and its short flags; unset ones
    take the model's defaults. For ``batch`` they are defaults (a line's own keys win), and there is no
    ``--prompt``."""
    group = parser.add_argument_group(f"generation{' defaults (a line’s own keys win)' if batch else ''}: the "
                                      f"options of {options.model} models (--model), defaults their reference "
                                      "pipeline's")
    if not batch:
        group.add_argument("--prompt", required=True, metavar="TEXT", help="what the video shows")
    group.add_argument("--seed", type=int, default=None if batch else 0, help="noise seed (default 0)")
    group.add_argument("--lora", dest="loras", action="append", default=None, type=_lora_arg,
                       metavar="NAME[:SCALE]", help=f"apply adapter NAME of --lora-dir with SCALE (default 1, in "
                       f"[{LORA_SCALE[0]:g}, {LORA_SCALE[1]:g}]); repeatable, at most {MAX_LORAS}"
                       + (" (a line's own loras win)" if batch else ""))
    for option in options:
        metavar = {str: "TEXT", tuple: "I,J", list: "JSON"}.get(option.kind, option.name.split("_")[-1].upper())
        group.add_argument(*_flags(option), dest=option.name, type=_option_type(option), default=None,
                           metavar=metavar, help=f"{option.help}; {option.describe()}{_limit_text(option)} (default "
                                                 f"{_default_text(option)})")


def request_from_args(args: argparse.Namespace, options: ModelOptions, **values: Any) -> GenerationRequest:
    """The request the generation flags set (unset options left for the model's defaults)."""
    given = {o.name: getattr(args, o.name) for o in options if getattr(args, o.name) is not None}
    return GenerationRequest.of(**values, **given, loras=tuple(args.loras or ()))


def parse_lora(text: str) -> LoraWeight:
    """``NAME[:SCALE]`` (``--lora``, a prompts file's ``loras`` strings) -> the adapter and its scale (default 1);
    ``ValueError`` if it is not that. The name and the scale are checked with the request."""
    name, colon, scale = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        return LoraWeight(name, float(scale) if colon else 1.0)
    except ValueError:
        raise ValueError(f"{text!r} is not NAME[:SCALE], e.g. style or style:0.8") from None


def _lora_arg(text: str) -> LoraWeight:
    try:
        return parse_lora(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _byte_count(text: str) -> int:
    """``--max-lora-bytes 8G``: a count of bytes, with an optional K, M or G (powers of 1024)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count, e.g. 8G or 536870912")
    return int(match.group(1)) * units[match.group(2).upper()]


def check_request_loras(adapters, request: GenerationRequest, stage_2) -> None:
    """A resolved request's adapters against the front end's catalog (``adapters``, :func:`lora_catalog`), and with
    the operator's ``stage_2`` adapters counted in stage 2 (``models.common.lora.check_stage_2``)."""
    from models.common.lora import check_stage_2

    adapters.check(request.loras)
    check_stage_2(request.loras, stage_2, stages=request.options.get("stages", 1))


def check_vae_tiling(config, info) -> None:
    """``config.vae_tiling`` (a ``RuntimeConfig``) for ``info``'s model: a ``UsageError`` naming --vae-tiling where
    its family has no tiled VAE."""
    from models.registry import check_vae_tiling as check

    try:
        check(info.family, config.vae_tiling)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_stage_2_loras(config, info) -> None:
    """``config.stage_2_loras`` (a ``RuntimeConfig``) are adapters of its ``--lora-dir`` that match ``info``'s model;
    a ``UsageError`` naming --stage-2-lora otherwise."""
    if not config.stage_2_loras:
        return
    try:
        lora_catalog(config, info).check(config.stage_2_loras)
    except ValueError as exc:
        raise UsageError(f"--stage-2-lora: {exc}".replace("loras[", "--stage-2-lora[")) from None


def lora_catalog(config, info):
    """What the front end checks a request's ``loras`` against (``models.common.lora.LoraCatalog``): the adapters of
    ``config.lora_dir`` (a ``RuntimeConfig``, or the parsed ``--lora-dir``) and the modules of ``info``'s model (with
    ``--compile``, also its adapter slots: ``--max-lora-rank``)."""
    from models.registry import lora_catalog as catalog

    return catalog(info, config.lora_dir, slot_rank=config.max_lora_rank if config.compile_blocks else None)


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    """``generate``'s conditioning media: an image to start from, a clip, or media at frames."""
    group = parser.add_argument_group(
        "conditioning media (PNG, JPEG, WebP, GIF, BMP images, MP4, MOV, WebM, MKV, AVI clips)")
    group.add_argument("--image", metavar="PATH", default=None,
                       help="image-to-video: the video starts from this image (the model's image-to-video pipeline)")
    group.add_argument("--video", metavar="PATH", default=None,
                       help="video-to-video: a clip at frame 0, strength 1 (the condition pipeline's video=); "
                            "at most --frames frames")
    group.add_argument("--condition", dest="condition", action="append", default=[], type=_condition_arg,
                       metavar="PATH@FRAME[:STRENGTH]",
                       help="an image or clip applied from output frame FRAME on (negative: from the end, -1 is the "
                            "last frame) with STRENGTH 0..1 (default 1: kept as it is); repeatable "
                            "(the condition pipeline's conditions)")


def parse_condition(text: str) -> tuple[str, int, float]:
    """``PATH@FRAME[:STRENGTH]`` -> ``(path, frame_index, strength)``; ``ValueError`` if it is not that."""
    path, at, where = text.rpartition("@")
    frame, colon, strength = where.partition(":")
    try:
        if not at or not path:
            raise ValueError
        return path, int(frame), float(strength) if colon else 1.0
    except ValueError:
        raise ValueError(f"{text!r} is not PATH@FRAME[:STRENGTH], e.g. clip.mp4@0, last.png@-1 or "
                         "mid.png@16:0.8") from None


def _condition_arg(text: str) -> tuple[str, str, int, float]:
    try:
        return (text, *parse_condition(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _block_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of block indices, "
                                         "e.g. 20,28") from None


def _number_list(text: str) -> tuple[float, ...]:
    """``--sigmas 1.0,0.99375,0.725``."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers, e.g. "
                                         "1.0,0.725,0.4") from None


# -------------------------------------------------------------------------------------- checks before a group


def quiet_libraries() -> None:
    import diffusers.utils.logging as diffusers_logging
    import transformers

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module=r"(diffusers|transformers)(\.|$)")
    # NOTE(warnings): torch deprecates all_gather_into_tensor (used by the engine's gather) once per rank;
    # engine business, not the CLI user's.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed(\.|$)")


def _typed_flag(flags: list[str], argv: Sequence[str]) -> str:
    for flag in flags:
        if any(arg == flag or arg.startswith(flag + "=") for arg in argv):
            return flag
    return flags[0]


def field_error(exc: ValueError, options: ModelOptions | None = None, argv: Sequence[str] = ()) -> UsageError:
    """Prefix a request error with the flag (of those in ``argv``, the one the user typed) that sets the option it
    names."""
    message = str(exc)
    match = re.match(r"(\w+)(\[\d*\])?(\.\w+)?[=\s:]", message)
    name = match.group(1) if match else None
    flags = {"prompt": ["--prompt"], "seed": ["--seed"], "loras": ["--lora"]}
    if options is not None:
        flags.update({o.name: _flags(o) for o in options})
    flag = _typed_flag(flags[name], argv) if name in flags else None
    return UsageError(f"{flag}: {message}" if flag else message)


def options_for(argv: Sequence[str]) -> ModelOptions:
    """The options of the model ``argv``'s ``--model`` (with its ``--config``, ``--upsampler``) names, from config
    files only (a hub repo's configs alone are fetched), so that the generation flags and their help are that model's.
    A model that cannot be described gets the default family's declared options (nothing is built or read for
    them): the run itself then reports the model's error (:func:`model_info`)."""
    from models.common.loading import ModelLoadError
    from models.registry import describe_model

    pre = argparse.ArgumentParser(add_help=False)
    for flag in ("--model", "--config", "--upsampler"):
        pre.add_argument(flag, default=None)
    known, _ = pre.parse_known_args(list(argv))
    try:
        return describe_model(known.model, config=known.config, upsampler=known.upsampler).options
    except (ModelLoadError, ValueError, OSError):
        return declared_default_options()


def declared_default_options() -> ModelOptions:
    """The default family's declared options, nothing built or read: the generation flags of a parser whose command
    generates nothing (``serve``, ``memory``: the default model is not built for them), or of a run whose model cannot
    be described."""
    from models.registry import default_model_options

    return default_model_options()


def model_info(config):
    """The model's family and video geometry from its config files only (no weights: a hub repo's configs alone are
    fetched), so requests are checked first."""
    from models.registry import describe_model

    return describe_model(config.model, config=config.model_config, upsampler=config.upsampler)


def fetch_model(config) -> None:
    """Every file of the model (``config``: a ``RuntimeConfig``) present on this node before any group forms: a hub
    repo downloaded into the hub cache here (one process per node; the ranks then find it there), a local folder,
    single file or paired upsampler checked and their configs read, an embedded default built. A model that cannot be
    had is a ``ModelLoadError`` here, reported in one line with exit code 2, instead of a failure on every rank.
    Nothing to do for the default model (no ``--model``), which the ranks build themselves."""
    if config.model is None and config.model_config is None and config.upsampler is None:
        return
    from models.common.loading import resolve_files
    from models.registry import describe_model

    # Its configs read too: a folder that is no model of a supported family fails here, not on the ranks.
    describe_model(resolve_files(config.model, config=config.model_config, upsampler=config.upsampler))


def check_device(config, *, nproc: int = 1) -> None:
    """Refuse a device the group cannot have, before anything starts: CUDA where there is none, or a node's ranks
    without a GPU each (``cp_infer.devices.cuda_ordinal``). ``nproc``: the ranks this process is about to launch
    (a rank already under torchrun checks its own place instead)."""
    import torch

    from cp_infer.devices import DeviceError, cuda_ordinal
    from server.cli.launch import in_torchrun

    if config.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine; use --device cpu")
    if config.device not in (None, "cuda") or not torch.cuda.is_available():
        return  # the CPU, or an explicit cuda:N
    env = dict(os.environ)
    if in_torchrun():
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None
    else:  # the launcher: its ranks will be torchrun's, sharing this environment
        local_rank, local_world = nproc - 1, nproc
        if nproc > 1:
            env.setdefault("TORCHELASTIC_RUN_ID", "cp-infer")
    try:
        cuda_ordinal(local_rank=local_rank, local_world_size=local_world, visible=torch.cuda.device_count(), env=env)
    except DeviceError as exc:
        raise UsageError(str(exc)) from None

"""The ``cp-infer`` command line: ``generate`` one video, run a ``batch`` of prompts, or ``serve`` HTTP.

Invariants:
- Every rank runs this same CLI with the same arguments (under torchrun, or relaunched there by ``--nproc``).
  Arguments, the model folder and a ``generate`` request are checked on every rank before any process group
  is formed; the checks are deterministic, so a bad value exits 2 on every rank and nothing hangs.
- Only rank 0 (the leader) reads the prompts file, decides what runs, prints and writes outputs. Every other
  rank runs ``worker_loop``, following the leader's ``Command``s until ``stop``. The leader sends ``stop`` on
  every path that leaves the group in step; on any other failure it exits non-zero without it, and torchrun
  stops the remaining ranks.
- ``generate --out -`` writes a fragmented MP4 to stdout as the decode delivers each piece (rank 0 alone).
  Every process of the command (the parent, torchrun's ranks) first points its fd 1 at stderr and keeps the real
  stdout for the video, so no print, log or library chatter can land inside the MP4 bytes.
- Exit codes: 0 success; 1 a generation failed (for ``batch``: any line not ok or skipped); 2 a bad argument,
  request, prompts file or model path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, BinaryIO

from cp_infer.request import GenerationRequest, check_request
from server.launch import group_size, in_torchrun, leader_exit_code, relaunch_under_torchrun

__all__ = ["main", "build_parser", "add_runtime_arguments", "runtime_config_from_args"]

log = logging.getLogger("cp_infer.cli")

_PROG = "cp-infer"
_USAGE_ERROR = 2
_DEFAULTS = {f.name: f.default for f in fields(GenerationRequest)}
# Request field -> CLI flag, to point error messages at what the user typed.
_FLAGS = {"prompt": "--prompt", "negative_prompt": "--negative-prompt", "num_frames": "--frames",
          "height": "--height", "width": "--width", "num_inference_steps": "--steps",
          "guidance_scale": "--guidance", "seed": "--seed", "fps": "--fps",
          # LTX-2 only (the loaded model's family decides; others refuse them)
          "audio_guidance_scale": "--audio-guidance", "stg_scale": "--stg", "audio_stg_scale": "--audio-stg",
          "modality_scale": "--modality", "audio_modality_scale": "--audio-modality",
          "guidance_rescale": "--guidance-rescale", "audio_guidance_rescale": "--audio-guidance-rescale",
          "stg_blocks": "--stg-blocks"}
_LTX2_FIELDS = ("audio_guidance_scale", "stg_scale", "audio_stg_scale", "modality_scale", "audio_modality_scale",
                "guidance_rescale", "audio_guidance_rescale", "stg_blocks")
# Batch line key -> request field (aliases: the CLI flag spelling and the request field spelling).
_BATCH_KEYS = {"prompt": "prompt", "negative_prompt": "negative_prompt", "frames": "num_frames",
               "num_frames": "num_frames", "height": "height", "width": "width", "steps": "num_inference_steps",
               "num_inference_steps": "num_inference_steps", "guidance": "guidance_scale",
               "guidance_scale": "guidance_scale", "seed": "seed", "fps": "fps",
               **{f: f for f in _LTX2_FIELDS}}
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class UsageError(ValueError):
    """A bad argument, request or file: reported in one line, exit code 2, nothing started."""


# ---------------------------------------------------------------------------------------------------- parser


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every rank needs to load the same model the same way (shared with ``serve``)."""
    group = parser.add_argument_group("model and parallelism")
    group.add_argument("--model", default=None, help="diffusers-format LTX-Video folder (default: the embedded "
                                                    "tiny-ltx-video)")
    group.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    group.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda when available")
    group.add_argument("--nproc", type=int, default=None, metavar="N",
                       help="ranks of the sequence-parallel group; N > 1 relaunches under torchrun (default 1, "
                            "or the torchrun world size)")


def runtime_config_from_args(args: argparse.Namespace):
    from server.runtime import RuntimeConfig

    return RuntimeConfig(model=args.model, dtype=args.dtype, device=args.device)


def _add_request_arguments(parser: argparse.ArgumentParser, *, batch: bool) -> None:
    group = parser.add_argument_group("generation" + (" defaults (a line's own keys win)" if batch else ""))

    def add(flag: str, field: str, kind: type, help_text: str, metavar: str | None = None) -> None:
        default = None if batch else _DEFAULTS[field]
        group.add_argument(flag, dest=field, type=kind, default=default, metavar=metavar or flag[2:].upper(),
                           help=f"{help_text} (default {_DEFAULTS[field]!r})")

    if not batch:
        group.add_argument("--prompt", required=True, metavar="TEXT", help="what the video shows")
    add("--negative-prompt", "negative_prompt", str, "what it should not show", "TEXT")
    add("--frames", "num_frames", int, "number of frames, 8k+1")
    add("--height", "height", int, "pixels, a multiple of 32")
    add("--width", "width", int, "pixels, a multiple of 32")
    add("--steps", "num_inference_steps", int, "denoising steps")
    add("--guidance", "guidance_scale", float, "classifier-free guidance scale; <= 1 turns it off")
    add("--seed", "seed", int, "noise seed")
    add("--fps", "fps", int, "frames per second (conditions the model and sets the output rate)")
    ltx2 = parser.add_argument_group("LTX-2 guidance (audio-video models only; default: LTX2Pipeline's)")
    for flag, field, help_text in (
        ("--audio-guidance", "audio_guidance_scale", "CFG scale of the soundtrack (7)"),
        ("--stg", "stg_scale", "spatio-temporal guidance of the video (1; 0 = off)"),
        ("--audio-stg", "audio_stg_scale", "spatio-temporal guidance of the soundtrack (1)"),
        ("--modality", "modality_scale", "modality-isolation guidance of the video (3; 1 = off)"),
        ("--audio-modality", "audio_modality_scale", "modality-isolation guidance of the soundtrack (3)"),
        ("--guidance-rescale", "guidance_rescale", "CFG rescale of the video, 0..1 (0.7)"),
        ("--audio-guidance-rescale", "audio_guidance_rescale", "CFG rescale of the soundtrack, 0..1 (0.7)"),
    ):
        ltx2.add_argument(flag, dest=field, type=float, default=None, metavar="X", help=help_text)
    ltx2.add_argument("--stg-blocks", dest="stg_blocks", type=_block_list, default=None, metavar="I,J",
                      help="transformer blocks that spatio-temporal guidance perturbs (28)")


def _block_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of block indices, "
                                         "e.g. 20,28") from None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_PROG, description="Long-video text-to-video inference with Ulysses "
                                     "sequence parallelism over a torchrun group.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{generate,batch,serve}")

    generate = commands.add_parser("generate", help="generate one video",
                                   description="Generate one video and write it as an MP4 or a frames folder.")
    _add_request_arguments(generate, batch=False)
    add_runtime_arguments(generate)
    generate.add_argument("--out", required=True, metavar="FILE.mp4|DIR/|-",
                          help="an .mp4 file, a folder (existing, or ending in '/') of lossless PNG frames, or '-': "
                               "a fragmented MP4 on stdout, written while the video is decoded")

    batch = commands.add_parser(
        "batch", help="generate every prompt of a JSONL file",
        description="One JSON object per line: 'prompt' (required), optional 'name' (the output's stem, default "
                    "the line number) and any generation option by name (negative_prompt, frames|num_frames, "
                    "height, width, steps|num_inference_steps, guidance|guidance_scale, seed, fps). The model "
                    "is loaded once; outputs that already exist are skipped, so a rerun resumes.")
    batch.add_argument("prompts", type=Path, metavar="PROMPTS.jsonl", help="one JSON object per line")
    batch.add_argument("--out-dir", type=Path, required=True, metavar="DIR", help="where outputs go (created)")
    batch.add_argument("--ext", choices=("mp4", "frames"), default="mp4",
                       help="NAME.mp4, or a NAME/ folder of PNG frames (default mp4)")
    _add_request_arguments(batch, batch=True)
    add_runtime_arguments(batch)

    # NOTE(serve): server.serve (FastAPI, uvicorn) is imported only when asked for, so generate and batch
    # neither pay for it nor depend on it.
    wants_serve = argv is not None and "serve" in argv[:1]
    serve = commands.add_parser("serve", help="run the HTTP server (cp-infer serve --help)", add_help=wants_serve)
    if wants_serve:
        try:
            from server import serve as serve_module
        except ModuleNotFoundError as exc:
            if exc.name != "server.serve":
                raise
            parser.exit(_USAGE_ERROR, f"{_PROG} serve: error: the HTTP server (server/serve.py) is not installed\n")
        serve_module.add_arguments(serve)
    return parser


# -------------------------------------------------------------------------------------------- shared steps


def _setup_logging() -> int:
    rank = int(os.environ.get("RANK", "0"))
    fmt = "%(levelname)s %(name)s: %(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=fmt, stream=sys.stderr)
    # Before diffusers/transformers are imported, so their import-time chatter is quiet too (and inherited by
    # the torchrun ranks).
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return rank


def _quiet_libraries() -> None:
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


def _field_error(exc: ValueError) -> UsageError:
    """Prefix a request error with the flag that sets the field it names."""
    message = str(exc)
    match = re.match(r"(\w+)[=\s]", message)
    flag = _FLAGS.get(match.group(1)) if match else None
    return UsageError(f"{flag}: {message}" if flag else message)


def _model_info(config):
    """The model's family and video geometry from its config files only (no weights), so requests are checked
    first."""
    from models.registry import describe_model

    return describe_model(config.model)


def _check_device(config) -> None:
    import torch

    if config.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine; use --device cpu")




class _Progress:
    """A tqdm bar on stderr for one job: steps, then "decode"."""

    def __init__(self, label: str, steps: int):
        from tqdm import tqdm

        self.label = label
        self.bar = tqdm(total=steps, desc=label, unit="step", file=sys.stderr, dynamic_ncols=True, leave=True)

    def control(self):
        from cp_infer.sampler import SampleControl

        return SampleControl(on_step=self._step, on_phase=self._phase, on_frames=self._frames)

    def _step(self, done: int, total: int, _seconds: float) -> None:
        self.bar.total = total
        self.bar.update(done - self.bar.n)

    def _phase(self, phase: str) -> None:
        if phase in ("decode", "done"):
            self.bar.set_description(f"{self.label} [{phase}]")

    def _frames(self, frames, first: int, total: int) -> None:
        self.bar.set_description(f"{self.label} [decode {first + len(frames)}/{total} frames]")

    def close(self) -> None:
        self.bar.close()


@dataclass
class _Generated:
    """One finished job on the leader."""

    frames: Any = None
    """uint8 ``[F, H, W, 3]``, or None when the frames were streamed."""
    audio: Any = None
    """float ``[C, S]`` waveform of audio-video models, else None."""
    sample_rate: int | None = None


@dataclass
class _Leader:
    """Rank 0's side of the group: every job is broadcast before it runs; ``stop`` ends the workers."""

    runtime: Any

    def generate(self, request: GenerationRequest, job_id: str, *, on_frames: Callable[..., None] | None = None,
                 on_audio: Callable[..., None] | None = None) -> _Generated:
        """The frames (``None`` with ``on_frames``, called with each decoded piece in order: no rank then holds the
        whole video) and, for audio-video models, the soundtrack (also handed to ``on_audio`` before the frames)."""
        from cp_infer import broadcast_object
        from server.runtime import Command

        broadcast_object(Command("generate", request, job_id), state=self.runtime.state)
        progress = _Progress(job_id, request.num_inference_steps)
        result = _Generated()

        def keep_audio(waveform, sample_rate: int) -> None:
            result.audio, result.sample_rate = waveform, sample_rate
            if on_audio is not None:
                on_audio(waveform, sample_rate)

        control = replace(progress.control(), on_audio=keep_audio)
        if on_frames is not None:
            def both(frames, first: int, total: int) -> None:
                on_frames(frames, first, total)
                progress._frames(frames, first, total)

            control = replace(control, on_frames=both, collect=False)
        try:
            result.frames = self.runtime.generate(request, control)
        finally:
            progress.close()
        return result

    def stop(self) -> None:
        from cp_infer import broadcast_object
        from server.runtime import Command

        broadcast_object(Command("stop"), state=self.runtime.state)


def _run_group(config, lead: Callable[[_Leader], int]) -> int:
    """Form the group and load the model on every rank; the leader runs ``lead``, the others follow."""
    from cp_infer import destroy_parallel
    from server.runtime import start_runtime, worker_loop

    runtime = start_runtime(config)
    try:
        if not runtime.state.is_leader:
            worker_loop(runtime)
            return 0
        return leader_exit_code(lead(_Leader(runtime)))
    finally:
        destroy_parallel(runtime.state)


# ------------------------------------------------------------------------------------------------ generate


def _check_out(out: str) -> None:
    from cp_infer.video_io import is_frames_dir_target

    if out == "-":
        return
    if not is_frames_dir_target(out) and Path(out).suffix.lower() != ".mp4":
        raise UsageError(f"--out {out}: name an .mp4 file, or end the path in '/' for a folder of PNG frames")
    existing = Path(out).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() and existing != Path(out).expanduser().absolute():
        raise UsageError(f"--out {out}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        raise UsageError(f"--out {out}: {existing} is not writable")


def _claim_stdout() -> BinaryIO:
    """The real stdout, for the video's bytes alone; fd 1 (``print``, C libraries, child processes) becomes stderr."""
    sys.stdout.flush()
    video = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return video


class _StdoutVideo:
    """A fragmented MP4 to stdout, each decoded piece encoded as it lands (rank 0's ``on_frames``).

    Never raises into the sampler (the other ranks are inside the decode): the first failure, e.g. a reader that
    closed the pipe, is kept; the rest of the video is then dropped and :meth:`close` raises ``_WriteError``."""

    def __init__(self, out: BinaryIO, request: GenerationRequest):
        from cp_infer.stream import FragmentedMP4Writer

        self.out, self.error = out, None
        self.request, self.audio, self.writer = request, None, None
        self._writer_cls = FragmentedMP4Writer

    def set_audio(self, waveform, sample_rate: int) -> None:
        """The soundtrack (audio-video models), before the first frames: muxed along with them."""
        self.audio = (waveform, sample_rate)

    def _open(self):
        if self.writer is None:
            waveform, sample_rate = self.audio or (None, None)
            self.writer = self._writer_cls(self._emit, width=self.request.width, height=self.request.height,
                                           fps=self.request.fps, audio=waveform, sample_rate=sample_rate)
        return self.writer

    def _emit(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()  # progressively: a reader gets each fragment as it is made

    def write(self, frames, _first: int, _total: int) -> None:
        if self.error is None:
            try:
                self._open().write(frames)
            except (OSError, ValueError) as exc:
                self.error = exc

    def close(self) -> int:
        """Finish the MP4; returns the number of frames written."""
        if self.error is None:
            try:
                self._open().close()
            except (OSError, ValueError) as exc:
                self.error = exc
        with contextlib.suppress(OSError):
            self.out.close()
        if self.error is not None:
            raise _WriteError(f"could not write the video to stdout: {type(self.error).__name__}: {self.error}")
        return self.writer.frames_written


def _cmd_generate(args: argparse.Namespace, argv: list[str]) -> int:
    video_out = _claim_stdout() if args.out == "-" else None
    request = GenerationRequest(**{f: getattr(args, f) for f in _FLAGS})
    config = runtime_config_from_args(args)
    nproc = group_size(args.nproc)
    _check_out(args.out)
    _quiet_libraries()
    _check_device(config)
    info = _model_info(config)
    try:
        check_request(request, geometry=info.geometry, limits=config.limits, family=info.family)
    except ValueError as exc:
        raise _field_error(exc) from exc
    if nproc > 1 and not in_torchrun():
        return relaunch_under_torchrun(nproc, argv, stdout=video_out)
    if video_out is not None and int(os.environ.get("RANK", "0")) != 0:
        video_out.close()  # rank 0 alone writes the video
        video_out = None

    def lead(leader: _Leader) -> int:
        if video_out is not None:
            return lead_to_stdout(leader)
        from cp_infer.sampler import JobFailed

        t_loaded = time.perf_counter()
        try:
            result = leader.generate(request, "steps")
        except JobFailed as exc:
            leader.stop()
            print(f"{_PROG} generate: generation failed: {exc}", file=sys.stderr)
            return 1
        leader.stop()
        t_generated = time.perf_counter()
        try:
            path = _writer()(result, args.out, request.fps)
        except _WriteError as exc:
            print(f"{_PROG} generate: {exc}", file=sys.stderr)
            return 1
        num_frames, height, width, _ = result.frames.shape
        print(f"wrote {path} ({num_frames} frames, {width}x{height} @ {request.fps} fps; "
              f"{leader.runtime.state.world_size} rank(s); load {t_loaded - started:.1f} s, generate "
              f"{t_generated - t_loaded:.1f} s, write {time.perf_counter() - t_generated:.1f} s, total "
              f"{time.perf_counter() - args.t0:.1f} s)", flush=True)
        return 0

    def lead_to_stdout(leader: _Leader) -> int:
        from cp_infer.sampler import JobFailed

        t_loaded = time.perf_counter()
        video = _StdoutVideo(video_out, request)
        try:
            leader.generate(request, "steps", on_frames=video.write, on_audio=video.set_audio)
        except JobFailed as exc:
            leader.stop()
            print(f"{_PROG} generate: generation failed: {exc}", file=sys.stderr)
            return 1
        leader.stop()
        try:
            num_frames = video.close()
        except _WriteError as exc:
            print(f"{_PROG} generate: {exc}", file=sys.stderr)
            return 1
        print(f"wrote stdout ({num_frames} frames, {request.width}x{request.height} @ {request.fps} fps, "
              f"fragmented MP4; {leader.runtime.state.world_size} rank(s); load {t_loaded - started:.1f} s, generate "
              f"and write {time.perf_counter() - t_loaded:.1f} s, total {time.perf_counter() - args.t0:.1f} s)",
              file=sys.stderr, flush=True)
        return 0

    started = time.perf_counter()
    return _run_group(config, lead)


# --------------------------------------------------------------------------------------------------- batch


@dataclass
class _Item:
    line: int
    name: str
    status: str
    """``todo`` until run, then ``ok`` or ``failed``; or ``skipped`` / ``invalid`` from the start."""
    request: GenerationRequest | None = None
    message: str = ""
    seconds: float | None = None


def _batch_output(out_dir: Path, name: str, ext: str) -> Path:
    return out_dir / (f"{name}.mp4" if ext == "mp4" else name)


def _output_done(path: Path, ext: str) -> bool:
    from cp_infer.video_io import VIDEO_JSON

    # Outputs are renamed into place complete (a frames folder: video.json last), so existing == done.
    return path.is_file() if ext == "mp4" else (path / VIDEO_JSON).is_file()


def _parse_line(text: str, line: int, defaults: dict[str, Any]) -> tuple[str, GenerationRequest]:
    """One JSONL line -> (output name, request); ``ValueError`` (carrying ``name`` once known) if it is bad."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _LineError(f"invalid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name", f"{line:05d}")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise _LineError(f"name={name!r} must be 1-128 of A-Z a-z 0-9 . _ - (not starting with . _ -)")
    unknown = sorted(set(obj) - set(_BATCH_KEYS) - {"name"})
    if unknown:
        raise _LineError(f"unknown key(s) {', '.join(map(repr, unknown))}; known: name, {', '.join(_BATCH_KEYS)}",
                         name)
    if "prompt" not in obj:
        raise _LineError("missing 'prompt'", name)
    values = dict(defaults)
    seen: dict[str, str] = {}
    for key, value in obj.items():
        if key == "name":
            continue
        field = _BATCH_KEYS[key]
        if field in seen:
            raise _LineError(f"both {seen[field]!r} and {key!r} set {field}; keep one", name)
        seen[field] = key
        values[field] = value
    return name, GenerationRequest(**values)


class _LineError(ValueError):
    def __init__(self, message: str, name: str = ""):
        super().__init__(message)
        self.name = name


def _plan_batch(args: argparse.Namespace, info, limits) -> list[_Item]:
    """Every non-blank line of the prompts file, checked: ``todo``, ``skipped`` (output exists) or ``invalid``."""
    try:
        text = args.prompts.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the prompts file {str(args.prompts)!r}: {exc}") from exc
    defaults = {f: getattr(args, f) for f in _FLAGS if f != "prompt" and getattr(args, f) is not None}
    items: list[_Item] = []
    names: dict[str, int] = {}
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            name, request = _parse_line(raw, line, defaults)
            if name in names:
                raise _LineError(f"name {name!r} is already used on line {names[name]}", name)
            names[name] = line
            try:
                check_request(request, geometry=info.geometry, limits=limits, family=info.family)
            except (ValueError, TypeError) as exc:
                raise _LineError(str(exc), name) from exc
        except _LineError as exc:
            items.append(_Item(line, exc.name, "invalid", message=str(exc)))
            continue
        if _output_done(_batch_output(args.out_dir, name, args.ext), args.ext):
            items.append(_Item(line, name, "skipped", message="output exists"))
        else:
            items.append(_Item(line, name, "todo", request=request))
    return items


def _summary(items: list[_Item]) -> int:
    rows = [("line", "name", "status", "seconds", "message")]
    rows += [(str(i.line), i.name or "-", i.status, "" if i.seconds is None else f"{i.seconds:.1f}", i.message)
             for i in items]
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)) + "  " + row[4])
    counts = {s: sum(i.status == s for i in items) for s in ("ok", "skipped", "invalid", "failed")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()), flush=True)
    return 0 if all(i.status in ("ok", "skipped") for i in items) else 1


class _WriteError(RuntimeError):
    """The video was generated but could not be written (disk full, permissions, ...)."""


def _writer() -> Callable[..., Path]:
    """``write_output`` with its failures (the job itself succeeded) raised as ``_WriteError``."""
    from cp_infer.video_io import write_output

    def write(result: _Generated, out, fps) -> Path:
        try:
            return write_output(result.frames, out, fps, audio=result.audio, sample_rate=result.sample_rate)
        except (OSError, ValueError) as exc:
            raise _WriteError(f"could not write {out}: {type(exc).__name__}: {exc}") from exc

    return write


def _lead_batch(leader: _Leader, items: list[_Item], args: argparse.Namespace) -> int:
    from cp_infer.sampler import JobFailed

    write_output = _writer()
    for item in items:
        if item.status == "invalid":
            log.warning("line %d: invalid: %s", item.line, item.message)
    try:
        for item in items:
            if item.status != "todo":
                continue
            started = time.perf_counter()
            path = _batch_output(args.out_dir, item.name, args.ext)
            # NOTE(group): JobFailed ends the job on every rank at the same step, and a write error happens
            # after the group is done with the job: either way the workers are back waiting for a command.
            # Any other exception from the group leaves it in an unknown state and aborts the batch.
            try:
                result = leader.generate(item.request, item.name)
                write_output(result, f"{path}/" if args.ext == "frames" else path, item.request.fps)
                item.status, item.message = "ok", str(path)
            except (JobFailed, _WriteError) as exc:
                item.status = "failed"
                item.message = str(exc) if isinstance(exc, _WriteError) else f"generation failed: {exc}"
                log.warning("line %d (%s): failed: %s", item.line, item.name, item.message)
            item.seconds = time.perf_counter() - started
    except BaseException:
        for item in items:
            if item.status == "todo":
                item.status, item.message = "failed", "not run: the batch was aborted"
        _summary(items)
        raise
    leader.stop()
    return _summary(items)


def _cmd_batch(args: argparse.Namespace, argv: list[str]) -> int:
    config = runtime_config_from_args(args)
    nproc = group_size(args.nproc)
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise UsageError(f"--out-dir {args.out_dir}: is a file, not a folder")
    _quiet_libraries()
    _check_device(config)
    info = _model_info(config)
    items = _plan_batch(args, info, config.limits) if int(os.environ.get("RANK", "0")) == 0 else []
    # Outside torchrun nothing is started when nothing is left to do. Under torchrun every rank must join
    # the group whatever the leader found (the workers cannot know), so the leader then just sends stop.
    if not in_torchrun() and not any(i.status == "todo" for i in items):
        return _summary(items)
    if nproc > 1 and not in_torchrun():
        return relaunch_under_torchrun(nproc, argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    return _run_group(config, lambda leader: _lead_batch(leader, items, args))


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = _setup_logging()
    args = build_parser(argv).parse_args(argv)
    args.t0 = t0
    if args.command == "serve":
        from server import serve  # present: build_parser imported it for the serve arguments

        args.cli_argv = argv  # for serve.run to pass to relaunch_under_torchrun
        return serve.run(args)
    run = {"generate": _cmd_generate, "batch": _cmd_batch}[args.command]
    where = "" if rank == 0 else f" [rank {rank}]"
    try:
        return run(args, argv)
    except ValueError as exc:  # UsageError, ModelLoadError, and request errors the group raised
        print(f"{_PROG} {args.command}{where}: error: {exc}", file=sys.stderr)
        return _USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())

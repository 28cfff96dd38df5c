"""The ``cp-infer`` command line: ``generate`` one video, run a ``batch`` of prompts, or ``serve`` HTTP.

Invariants:
- Every rank runs this same CLI with the same arguments (under torchrun, or relaunched there by ``--nproc``).
  Arguments, the model folder and a ``generate`` request are checked on every rank before any process group
  is formed; the checks are deterministic, so a bad value exits 2 on every rank and nothing hangs.
- Only rank 0 (the leader) decides what runs, prints and writes outputs. Every other rank runs ``worker_loop``,
  following the leader's ``Command``s until ``stop``. The leader sends ``stop`` on every path that leaves the group
  in step; on any other failure it exits non-zero without it, and torchrun stops the remaining ranks. (What
  ``generate`` and ``batch`` share is in ``server.cli.common``; ``batch`` itself in ``server.cli.batch``.)
- An audio-video model's soundtrack goes into the output with its frames: AAC in an MP4, ``audio.wav`` in a frames
  folder; on stdout it is muxed into the fragments as the frames arrive (the sampler hands it over first).
- ``generate --image/--video/--condition`` files are read and decoded (a clip: at most ``--frames`` frames) and the
  request with them checked before any group forms: a bad file exits 2 naming the flag and the file. A frames
  folder (``--out DIR/``) also gets the final latents, ``latents.npy`` (and ``audio_latents.npy`` for LTX-2): the
  arrays the reference pipeline returns for ``output_type="latent"``.
- ``generate --out x.mp4`` encodes each piece as the decode delivers it (rank 0 alone), into a hidden temporary
  file renamed to ``x.mp4`` once complete; the file is the one ``write_output`` makes of the whole video.
- ``generate --out -`` writes a fragmented MP4 to stdout as the decode delivers each piece (rank 0 alone).
  Every process of the command (the parent, torchrun's ranks) first points its fd 1 at stderr and keeps the real
  stdout for the video, so no print, log or library chatter can land inside the MP4 bytes.
- Run as the program, the CLI ends with ``os._exit`` once its outputs are closed and its streams flushed, without
  the interpreter's teardown of torch and diffusers; ``main(argv)`` called with arguments returns.
- Exit codes: 0 success; 1 a generation failed (for ``batch``: any line not ok or skipped); 2 a bad argument,
  request, prompts file or model path.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import BinaryIO

from cp_infer.options import ModelOptions
from cp_infer.request import GenerationRequest, check_request, resolve_request
from server.cli.batch import add_batch_parser, run_batch
from server.cli.common import (
    PROG,
    USAGE_ERROR,
    UsageError,
    WriteError,
    add_media_arguments,
    add_request_arguments,
    add_runtime_arguments,
    check_device,
    check_request_loras,
    check_stage_2_loras,
    check_vae_tiling,
    declared_default_options,
    fetch_model,
    guidance_first,
    lora_catalog,
    model_info,
    options_for,
    quiet_libraries,
    request_from_args,
    runtime_config_from_args,
)
from server.cli.keys import add_keys_parser, run_keys
from server.cli.launch import group_size, in_torchrun, relaunch_under_torchrun, under_launcher
from server.cli.lead import Generated, Leader, result_writer, run_group
from server.cli.media_args import MediaRef, attach_media, media_error
from server.cli.memory import add_memory_parser, run_memory
from server.group import phases, process
from server.outputs.piece_video import FileVideo, PieceVideo, StdoutVideo

__all__ = ["main", "build_parser", "add_runtime_arguments", "runtime_config_from_args"]


def build_parser(argv: list[str] | None = None, options: ModelOptions | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; the generation flags are those ``options`` declares (default: the options of the model
    that ``argv``'s ``--model`` names)."""
    if options is None:
        wants_options = argv is not None and argv[:1] in (["generate"], ["batch"])
        options = options_for(argv[1:]) if wants_options else declared_default_options()
    parser = argparse.ArgumentParser(prog=PROG, description="Long-video text-to-video inference with Ulysses "
                                     "sequence parallelism over a torchrun group.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{generate,batch,serve,memory,keys}")

    generate = commands.add_parser("generate", help="generate one video",
                                   description="Generate one video and write it as an MP4 or a frames folder "
                                               "(LTX-2 models: with their soundtrack, AAC in the MP4, audio.wav in "
                                               "the folder).")
    add_request_arguments(generate, options, batch=False)
    add_media_arguments(generate)
    add_runtime_arguments(generate)
    generate.add_argument("--out", required=True, metavar="FILE.mp4|DIR/|-",
                          help="an .mp4 file, a folder (existing, or ending in '/') of lossless PNG frames and the "
                               "final latents (latents.npy), or '-': a fragmented MP4 on stdout, written while the "
                               "video is decoded")
    generate.add_argument("--live", action="store_true",
                          help="a live video: its first windows (--frames: whole windows) from --prompt, then one "
                               "direction a line from standard input ('3 | the fox jumps': 3 more windows; a prompt "
                               "alone: one; 'end' or the input's end: the video ends after what is directed)")
    generate.add_argument("--live-idle-s", type=float, default=120.0, metavar="S",
                          help="with --live: once every directed window is made, end the video after S seconds "
                               "without a new line (default 120)")
    add_batch_parser(commands, options)
    add_memory_parser(commands)
    add_keys_parser(commands)

    # NOTE(serve): server.cli.serve (FastAPI, uvicorn) is imported only when asked for, so generate and batch
    # neither pay for it nor depend on it.
    wants_serve = argv is not None and "serve" in argv[:1]
    serve = commands.add_parser("serve", help="run the HTTP server (cp-infer serve --help)", add_help=wants_serve)
    if wants_serve:
        try:
            from server.cli import serve as serve_module
        except ModuleNotFoundError as exc:
            if exc.name != "server.cli.serve":
                raise
            parser.exit(USAGE_ERROR, f"{PROG} serve: error: the HTTP server (server/cli/serve.py) is not installed\n")
        serve_module.add_arguments(serve)
    return parser


def _setup_logging(command: str) -> int:
    """Logging for this process; in a group also its title and its rank's log file (``server.group.process``)."""
    rank = int(os.environ.get("RANK", "0"))
    fmt = "%(levelname)s %(name)s: %(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=fmt, stream=sys.stderr)
    if in_torchrun():
        process.set_title(command or PROG, f"rank {rank}/{os.environ.get('WORLD_SIZE', '1')}")
        process.attach_rank_log(rank, fmt)
    # Before diffusers/transformers are imported, so their import-time chatter is quiet too (and inherited by
    # the torchrun ranks).
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    return rank


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


def _media_refs(args: argparse.Namespace) -> tuple[MediaRef | None, tuple[MediaRef, ...]]:
    """``--image``, and ``--video`` then each ``--condition`` (the request's ``conditions`` in that order)."""
    if args.image is not None and (args.video is not None or args.condition):
        given = "--video" if args.video is not None else "--condition"
        raise UsageError(f"--image and {given} were both given: --image is image-to-video on its own; to combine "
                         f"media give the image as --condition {args.image}@0")
    image = None if args.image is None else MediaRef(f"--image {args.image}", Path(args.image).expanduser(),
                                                     kind="image")
    conditions = [] if args.video is None else [MediaRef(f"--video {args.video}", Path(args.video).expanduser(),
                                                         kind="video")]
    for text, path, frame_index, strength in args.condition:
        conditions.append(MediaRef(f"--condition {text}", Path(path).expanduser(), frame_index=frame_index,
                                   strength=strength))
    return image, tuple(conditions)


def _cache_note(result: Generated) -> str:
    """The summary line's part for a step cache, ``"2 steps computed, 8 skipped; "``; empty without one."""
    if result.cache is None:
        return ""
    computed, skipped = result.cache.steps_computed, result.cache.steps_skipped
    return f"{computed} step{'s' if computed != 1 else ''} computed, {skipped} skipped; "


def _cmd_generate(args: argparse.Namespace, argv: list[str]) -> int:
    video_out = _claim_stdout() if args.out == "-" else None
    config = runtime_config_from_args(args)
    nproc = group_size(args.nproc)
    _check_out(args.out)
    image, conditions = _media_refs(args)
    quiet_libraries()
    check_device(config, nproc=nproc)
    info = model_info(config)
    adapters = lora_catalog(config, info)
    check_stage_2_loras(config, info)
    check_vae_tiling(config, info)

    def check(request: GenerationRequest, *, media_pending: bool = False) -> GenerationRequest:
        try:
            request = resolve_request(request, info.options, limits=config.limits, geometry=info.geometry)
            check_request(request, geometry=info.geometry, limits=config.limits, options=info.options,
                          media_pending=media_pending)
            check_request_loras(adapters, request, config.stage_2_loras)
        except ValueError as exc:
            raise media_error(exc, image=image, conditions=conditions, conditions_label="--video/--condition",
                              options=info.options, argv=argv) from exc
        return request

    # The frames count is good before a clip is decoded up to it.
    request = check(request_from_args(args, info.options, prompt=args.prompt, seed=args.seed),
                    media_pending=image is not None or bool(conditions))
    if image is not None or conditions:
        request = attach_media(request, image=image, conditions=conditions)
        check(request)
    live = None
    if args.live:  # the first direction, checked here as every later one is (server.cli.live_stdin)
        from cp_infer.live import Direction, live_request, windows_for_frames

        if request.options.get("prompt_segments"):
            raise ValueError("--prompt-segments: a live video's prompts are its directions (lines of standard "
                             "input); leave --prompt-segments out")
        live = [Direction(request.prompt, windows_for_frames(request, info.options))]
        request = check(live_request(request, live, info.options))
    # Every rank runs these checks on the same request, so each picks the same layout.
    config = guidance_first(config, args, info, [request])
    if not under_launcher():  # the launcher's own process fetched it for its ranks
        fetch_model(config)
    phases.mark("checks")
    if nproc > 1 and not in_torchrun():
        code = relaunch_under_torchrun(nproc, argv, stdout=video_out, device=config.device)
        phases.mark("group")
        return code
    if video_out is not None and int(os.environ.get("RANK", "0")) != 0:
        video_out.close()  # rank 0 alone writes the video
        video_out = None

    def ran(leader: Leader, result: Generated, t_loaded: float, t_generated: float | None = None) -> str:
        """The summary line's tail: ranks, the step cache, the seconds of each phase (``t_generated`` None: the
        video was written while it was generated)."""
        now = time.perf_counter()
        phase_s = (f"generate and write {now - t_loaded:.1f} s" if t_generated is None
                   else f"generate {t_generated - t_loaded:.1f} s, write {now - t_generated:.1f} s")
        return (f"{leader.runtime.state.world_size} rank(s); {_cache_note(result)}load {t_loaded - started:.1f} s, "
                f"{phase_s}, total {now - args.t0:.1f} s")

    def extend():
        """With --live: rank 0's directions from standard input (made once the group is up)."""
        if live is None:
            return None
        from server.cli.live_stdin import StdinDirections

        return StdinDirections(request, list(live), options=info.options, check=check,
                               idle_s=args.live_idle_s).extend

    def lead(leader: Leader) -> int:
        leader.extend = extend()
        if video_out is not None:
            return lead_to_stdout(leader)
        from cp_infer.sampler import JobFailed
        from cp_infer.video_io import is_frames_dir_target

        if not is_frames_dir_target(args.out):
            return lead_to_file(leader)  # an .mp4: encoded while the decode runs

        t_loaded = time.perf_counter()
        try:
            result = leader.generate(request, "steps")
        except JobFailed as exc:
            leader.stop()
            print(f"{PROG} generate: generation failed: {exc}", file=sys.stderr)
            return 1
        leader.stop()
        t_generated = time.perf_counter()
        try:
            path = result_writer()(result, args.out, request.fps)
        except WriteError as exc:
            print(f"{PROG} generate: {exc}", file=sys.stderr)
            return 1
        phases.mark("encode")
        num_frames, height, width, _ = result.frames.shape
        print(f"wrote {path} ({num_frames} frames, {width}x{height} @ {request.fps} fps; "
              f"{ran(leader, result, t_loaded, t_generated)})", flush=True)
        return 0

    def generate_into(leader: Leader, video: PieceVideo) -> Generated | None:
        """Run the job with ``video`` encoding each decoded piece; None (reported) when it failed on the group."""
        from cp_infer.sampler import JobFailed

        try:
            result = leader.generate(request, "steps", on_frames=video.write, on_audio=video.set_audio,
                                     on_audio_piece=video.add_audio)
        except JobFailed as exc:
            video.abort()
            leader.stop()
            print(f"{PROG} generate: generation failed: {exc}", file=sys.stderr)
            return None
        except BaseException:
            video.abort()
            raise
        leader.stop()
        return result

    def lead_to_file(leader: Leader) -> int:
        t_loaded = time.perf_counter()
        video = FileVideo(args.out, request)
        result = generate_into(leader, video)
        if result is None:
            return 1
        t_generated = time.perf_counter()
        try:
            path, num_frames = video.close()
        except WriteError as exc:
            print(f"{PROG} generate: {exc}", file=sys.stderr)
            return 1
        phases.mark("encode")
        print(f"wrote {path} ({num_frames} frames, {request.width}x{request.height} @ {request.fps} fps; "
              f"{ran(leader, result, t_loaded, t_generated)})", flush=True)
        return 0

    def lead_to_stdout(leader: Leader) -> int:
        t_loaded = time.perf_counter()
        video = StdoutVideo(video_out, request)
        result = generate_into(leader, video)
        if result is None:
            return 1
        try:
            num_frames = video.close()
        except WriteError as exc:
            print(f"{PROG} generate: {exc}", file=sys.stderr)
            return 1
        phases.mark("encode")
        print(f"wrote stdout ({num_frames} frames, {request.width}x{request.height} @ {request.fps} fps, "
              f"fragmented MP4; {ran(leader, result, t_loaded)})", file=sys.stderr, flush=True)
        return 0

    started = time.perf_counter()
    return run_group(config, lead)


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    phases.mark("imports")
    program = argv is None  # the program's own command line (tests and callers pass argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = _setup_logging(argv[0] if argv else "")
    options = options_for(argv[1:]) if argv[:1] in (["generate"], ["batch"]) else None
    parser = build_parser(argv, options)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = next((a for a in unknown if a.startswith("-")), unknown[0]).split("=", 1)[0]
        if options is None or not flag.startswith("--"):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        # The generation flags are the loaded model's: an option it does not declare is refused, naming it.
        print(f"{PROG} {args.command}: error: {flag}: not an option of {options.model} models (the model that "
              f"--model names); its options: {PROG} {args.command} --model ... --help", file=sys.stderr)
        return USAGE_ERROR
    args.t0 = t0
    if args.command == "serve":
        from server.cli import serve  # present: build_parser imported it for the serve arguments

        args.cli_argv = argv  # for serve.run to pass to relaunch_under_torchrun
        run = lambda args, _argv: serve.run(args)  # noqa: E731
    else:
        run = {"generate": _cmd_generate, "batch": run_batch, "memory": run_memory, "keys": run_keys}[args.command]
    where = "" if rank == 0 else f" [rank {rank}]"
    try:
        code = run(args, argv)
    except ValueError as exc:  # UsageError, ModelLoadError, and request errors the group raised
        process.log_failure(exc)
        if rank == 0 or not under_launcher():  # the other ranks would say the same
            print(f"{PROG} {args.command}{where}: error: {exc}", file=sys.stderr)
        code = USAGE_ERROR
    except Exception as exc:
        if not in_torchrun():
            raise  # one process: its traceback is the log
        # A rank of a group: the traceback goes to its log file; the terminal gets one line naming it, from the
        # launcher when there is one (it reports the rank that failed first), else from this rank.
        log_file = process.log_failure(exc)
        if not under_launcher():
            where_log = f" (traceback: {log_file})" if log_file else ""
            print(f"{PROG} {args.command}{where}: error: {type(exc).__name__}: {exc}{where_log}", file=sys.stderr)
        code = 1
    if program and not in_torchrun() and args.command != "serve":  # serve's process ends as it always has
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the program without the interpreter's teardown of torch, diffusers and transformers (most of a second):
    everything this command wrote is closed by now; the standard streams are flushed here."""
    logging.shutdown()
    phases.write()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

"""``cp-infer batch``: generate every prompt of a JSONL file with the model loaded once.

Invariants:
- Only rank 0 (the leader) reads the prompts file. Every line is checked (JSON, keys, name, its media files, the
  request against the model's limits, family and geometry) before the group forms; a bad line is reported
  ``invalid`` and the rest run.
- A line's media (``image``, ``video``, ``conditions``; relative paths from the prompts file's folder) is decoded
  for that check and again just before the line runs, so that no more than one line's media is held at a time. A
  file that can no longer be read, or now decodes to another frame count, fails that line only. With replica
  groups (``--ulysses-degree`` x ``--guidance-degree`` smaller than the ranks), each replica runs the next line as
  soon as it is free, so as many lines run at once (and hold their media) as there are replicas.
- Outputs appear under their final name only once complete (``write_output`` renames them into place), so an
  existing output means a finished one: a rerun skips it, and resumes where the last run stopped. Outside torchrun
  nothing is started when nothing is left to do.
- A job that fails (``JobFailed``: every rank left it at the same step) or whose output cannot be written is
  reported ``failed`` and the batch goes on; any other exception from the group aborts it, after the summary.
- Exit code: 0 when every line is ``ok`` or ``skipped``, else 1; 2 for a bad argument or an unreadable file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cp_infer.options import ModelOptions
from cp_infer.request import GenerationRequest, LoraWeight, check_request, loras_from, resolve_request
from server.cli.common import (
    UsageError,
    WriteError,
    add_request_arguments,
    add_runtime_arguments,
    check_device,
    check_request_loras,
    check_stage_2_loras,
    check_vae_tiling,
    fetch_model,
    guidance_first,
    lora_catalog,
    model_info,
    option_keys,
    parse_condition,
    parse_lora,
    quiet_libraries,
    runtime_config_from_args,
)
from server.cli.launch import group_size, in_torchrun, relaunch_under_torchrun, under_launcher
from server.cli.lead import Leader, result_writer, run_group
from server.cli.media_args import MediaRef, attach_media, media_error
from server.outputs.piece_video import FileVideo

__all__ = ["add_batch_parser", "run_batch"]

log = logging.getLogger("cp_infer.cli")

# Conditioning media keys, and the keys of one ``conditions`` object. The other keys are prompt, seed and the
# model's options (``cli_common.option_keys``).
_MEDIA_KEYS = ("image", "video", "conditions")
_LORAS = "loras"
_CONDITION_KEYS = ("media", "frame_index", "strength")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def add_batch_parser(commands, options: ModelOptions) -> argparse.ArgumentParser:
    """The ``batch`` subcommand on the CLI's subparsers; ``options``: the loaded model's."""
    keys = ", ".join(option_keys(options))
    batch = commands.add_parser(
        "batch", help="generate every prompt of a JSONL file",
        description="One JSON object per line: 'prompt' (required), optional 'name' (the output's stem, default "
                    "the line number), 'seed', and any option of the model by name, alias or flag name "
                    f"({keys}). Media, paths relative to the prompts file's folder: 'image' (image-to-video), "
                    "'video' (a clip at frame 0), or 'conditions': a list of {\"media\": PATH, \"frame_index\": 0, "
                    "\"strength\": 1.0} or \"PATH@FRAME[:STRENGTH]\" items. Adapters of --lora-dir: 'loras', a list "
                    "of {\"name\": NAME, \"scale\": 1.0} or \"NAME[:SCALE]\" items. The model is loaded once; outputs "
                    "that already exist are skipped, so a rerun resumes.")
    batch.add_argument("prompts", type=Path, metavar="PROMPTS.jsonl", help="one JSON object per line")
    batch.add_argument("--out-dir", type=Path, required=True, metavar="DIR", help="where outputs go (created)")
    batch.add_argument("--ext", choices=("mp4", "frames"), default="mp4",
                       help="NAME.mp4, or a NAME/ folder of PNG frames, the final latents (latents.npy) and, for "
                            "LTX-2, audio.wav and audio_latents.npy (default mp4)")
    add_request_arguments(batch, options, batch=True)
    add_runtime_arguments(batch)
    return batch


@dataclass(frozen=True)
class _LineMedia:
    """A line's conditioning files, read when the line is checked and again when it runs."""

    image: MediaRef | None = None
    conditions: tuple[MediaRef, ...] = ()
    """``video`` first, then the line's ``conditions``: the request's ``conditions`` in order."""
    frame_counts: tuple[int, ...] = ()
    """Frames of each file (``image`` first) when the line was checked: the check holds while they are the same."""


@dataclass
class _Item:
    line: int
    name: str
    status: str
    """``todo`` until run, then ``ok`` or ``failed``; or ``skipped`` / ``invalid`` from the start."""
    request: GenerationRequest | None = None
    """Checked with its media; held without them (``media`` says which files to read)."""
    media: _LineMedia | None = None
    message: str = ""
    seconds: float | None = None


class _LineError(ValueError):
    def __init__(self, message: str, name: str = ""):
        super().__init__(message)
        self.name = name


def _batch_output(out_dir: Path, name: str, ext: str) -> Path:
    return out_dir / (f"{name}.mp4" if ext == "mp4" else name)


def _output_done(path: Path, ext: str) -> bool:
    from cp_infer.video_io import VIDEO_JSON

    # Outputs are renamed into place complete (a frames folder: video.json last), so existing == done.
    return path.is_file() if ext == "mp4" else (path / VIDEO_JSON).is_file()


def _media_path(value: object, label: str, base: Path, name: str) -> Path:
    if not isinstance(value, str) or not value:
        raise _LineError(f"{label} must be a file path (a non-empty string), got {value!r}", name)
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def _parse_media(obj: dict[str, Any], base: Path, name: str) -> _LineMedia | None:
    """A line's ``image``, ``video`` and ``conditions`` -> the files to read (not read yet)."""
    image, video, conditions = (obj.get(key) for key in _MEDIA_KEYS)
    if image is None and video is None and conditions is None:
        return None
    if image is not None and (video is not None or conditions is not None):
        raise _LineError("'image' and 'video'/'conditions' were both given: 'image' is image-to-video on its own; "
                         "to combine media give the image as a condition, e.g. \"conditions\": [\"photo.png@0\"]",
                         name)
    if image is not None:
        return _LineMedia(image=MediaRef(f"image ({image})", _media_path(image, "image", base, name), kind="image"))
    refs = [] if video is None else [MediaRef(f"video ({video})", _media_path(video, "video", base, name),
                                              kind="video")]
    if conditions is not None and not isinstance(conditions, list):
        raise _LineError(f"conditions must be a list of {{\"media\": PATH, \"frame_index\": F, \"strength\": S}} "
                         f"or \"PATH@FRAME[:STRENGTH]\" items, got {type(conditions).__name__}", name)
    for j, item in enumerate(conditions or []):
        key = f"conditions[{j}]"
        if isinstance(item, str):
            try:
                path, frame_index, strength = parse_condition(item)
            except ValueError as exc:
                raise _LineError(f"{key}: {exc}", name) from exc
            refs.append(MediaRef(f"{key} ({item})", _media_path(path, key, base, name), frame_index=frame_index,
                                 strength=strength))
        elif isinstance(item, dict):
            unknown = sorted(set(item) - set(_CONDITION_KEYS))
            if unknown or "media" not in item:
                problem = f"unknown key(s) {', '.join(map(repr, unknown))}" if unknown else "no 'media'"
                raise _LineError(f"{key} has {problem}; known: {', '.join(_CONDITION_KEYS)} ('media' required)",
                                 name)
            refs.append(MediaRef(f"{key} ({item['media']})", _media_path(item["media"], f"{key}.media", base, name),
                                 frame_index=item.get("frame_index", 0), strength=item.get("strength", 1.0)))
        else:
            raise _LineError(f"{key} must be an object or a \"PATH@FRAME[:STRENGTH]\" string, got "
                             f"{type(item).__name__}", name)
    return _LineMedia(conditions=tuple(refs))


def _frame_counts(request: GenerationRequest) -> tuple[int, ...]:
    media = ([] if request.image is None else [request.image]) + list(request.conditions)
    return tuple(c.frames.shape[0] for c in media)


def _with_media(request: GenerationRequest, media: _LineMedia) -> GenerationRequest:
    """The request with its files read and decoded; ``UsageError`` naming the key and file."""
    return attach_media(request, image=media.image, conditions=media.conditions)


def _parse_line(text: str, line: int, defaults: dict[str, Any], base: Path,
                options: ModelOptions) -> tuple[str, GenerationRequest, _LineMedia | None]:
    """One JSONL line -> (output name, request without media, the media files it names, relative to ``base``);
    ``_LineError`` (carrying ``name`` once known) if it is bad."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _LineError(f"invalid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name", f"{line:05d}")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise _LineError(f"name={name!r} must be 1-128 of A-Z a-z 0-9 . _ - (not starting with . _ -)")
    keys = {"prompt": "prompt", "seed": "seed", _LORAS: _LORAS, **option_keys(options)}
    unknown = sorted(set(obj) - set(keys) - {"name", *_MEDIA_KEYS})
    if unknown:
        raise _LineError(f"unknown key(s) {', '.join(map(repr, unknown))}: not options of {options.model} models; "
                         f"known: name, {', '.join(keys)}, {', '.join(_MEDIA_KEYS)}", name)
    if _LORAS in obj:
        obj = {**obj, _LORAS: _parse_loras(obj[_LORAS], name)}
    if "prompt" not in obj:
        raise _LineError("missing 'prompt'", name)
    values = dict(defaults)
    seen: dict[str, str] = {}
    media = _parse_media(obj, base, name)
    for key, value in obj.items():
        if key == "name" or key in _MEDIA_KEYS:
            continue
        field = keys[key]
        if field in seen:
            raise _LineError(f"both {seen[field]!r} and {key!r} set {field}; keep one", name)
        seen[field] = key
        values[field] = value
    return name, GenerationRequest.of(**values), media


def _parse_loras(value: object, name: str) -> tuple[LoraWeight, ...]:
    """A line's ``loras``: ``[{"name": "style", "scale": 0.8}, "other:0.5", ...]``."""
    if not isinstance(value, list):
        raise _LineError(f"loras must be a list of {{\"name\": NAME, \"scale\": S}} or \"NAME[:SCALE]\" items, got "
                         f"{type(value).__name__}", name)
    items = []
    for j, item in enumerate(value):
        if isinstance(item, str):
            try:
                items.append(parse_lora(item))
            except ValueError as exc:
                raise _LineError(f"loras[{j}]: {exc}", name) from None
        else:
            items.append(item)
    try:
        return loras_from(items)
    except ValueError as exc:
        raise _LineError(str(exc), name) from None


def _plan_batch(args: argparse.Namespace, info, limits) -> list[_Item]:
    """Every non-blank line of the prompts file, checked against the model ``info`` (``models.registry.ModelInfo``):
    ``todo``, ``skipped`` (output exists) or ``invalid``."""
    try:
        text = args.prompts.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the prompts file {str(args.prompts)!r}: {exc}") from exc
    flags = ("seed", "loras", *info.options.names)
    defaults = {f: getattr(args, f) for f in flags if getattr(args, f, None) is not None}
    adapters = lora_catalog(args, info)  # --lora-dir
    items: list[_Item] = []
    names: dict[str, int] = {}
    base = args.prompts.parent

    def check(request: GenerationRequest, media: _LineMedia | None, name: str, *,
              media_pending: bool = False) -> GenerationRequest:
        try:
            request = resolve_request(request, info.options, limits=limits, geometry=info.geometry)
            check_request(request, geometry=info.geometry, limits=limits, options=info.options,
                          media_pending=media_pending)
            check_request_loras(adapters, request, tuple(getattr(args, "stage_2_loras", None) or ()))
            return request
        except (ValueError, TypeError) as exc:
            if media is None or isinstance(exc, TypeError):
                raise _LineError(str(exc), name) from exc
            raise _LineError(str(media_error(exc, image=media.image, conditions=media.conditions)), name) from exc

    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            name, request, media = _parse_line(raw, line, defaults, base, info.options)
            if name in names:
                raise _LineError(f"name {name!r} is already used on line {names[name]}", name)
            names[name] = line
            # the frames count is good before a clip is decoded up to it
            request = check(request, media, name, media_pending=media is not None)
            done = _output_done(_batch_output(args.out_dir, name, args.ext), args.ext)
            if media is not None and not done:
                try:
                    conditioned = _with_media(request, media)
                except UsageError as exc:
                    raise _LineError(str(exc), name) from exc
                check(conditioned, media, name)
                media = replace(media, frame_counts=_frame_counts(conditioned))
        except _LineError as exc:
            items.append(_Item(line, exc.name, "invalid", message=str(exc)))
            continue
        if done:
            items.append(_Item(line, name, "skipped", message="output exists"))
        else:
            items.append(_Item(line, name, "todo", request=request, media=media))
    return items


def _request_to_run(item: _Item) -> GenerationRequest:
    """``item``'s request with its media read again (``UsageError`` if a file went bad since it was checked)."""
    if item.media is None:
        return item.request
    request = _with_media(item.request, item.media)
    counts = _frame_counts(request)
    if counts != item.media.frame_counts:
        raise UsageError(f"its media changed since the batch was checked (frames {list(item.media.frame_counts)}, "
                         f"now {list(counts)}); run the batch again")
    return request


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


def _lead_batch(leader: Leader, items: list[_Item], args: argparse.Namespace) -> int:
    for item in items:
        if item.status == "invalid":
            log.warning("line %d: invalid: %s", item.line, item.message)
    try:
        if getattr(leader, "replicas", ()):
            _run_on_replicas((leader, *leader.replicas), items, args)
        else:
            _run_items(leader, iter(items), args)
    except BaseException:
        for item in items:
            if item.status == "todo":
                item.status, item.message = "failed", "not run: the batch was aborted"
        _summary(items)
        raise
    leader.stop()
    return _summary(items)


def _run_on_replicas(leaders: tuple[Leader, ...], items: list[_Item], args: argparse.Namespace) -> None:
    """Every replica group runs lines from one shared list, each taking the next as soon as it is free; the first
    exception that aborts the batch stops every replica taking more and is raised once they have all stopped."""
    import threading

    lock, todo, errors = threading.Lock(), iter(items), []

    def next_items():
        while not errors:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            yield item

    def run(leader: Leader, replica: int) -> None:
        try:
            _run_items(leader, next_items(), args, replica)
        except BaseException as exc:  # noqa: BLE001 -- raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(leader, i), name=f"cp-infer-replica-{i}", daemon=True)
               for i, leader in enumerate(leaders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _run_items(leader: Leader, items, args: argparse.Namespace, replica: int | None = None) -> None:
    """Run the ``todo`` lines of ``items`` (an iterator) one after another on ``leader``'s group (``replica``: its
    index, logged with each line, when the batch runs on several)."""
    from cp_infer.sampler import JobFailed

    write_output = result_writer()
    for item in items:
        if item.status != "todo":
            continue
        if replica is not None:
            log.info("line %d (%s) runs on replica %d", item.line, item.name, replica)
        started = time.perf_counter()
        path = _batch_output(args.out_dir, item.name, args.ext)
        # NOTE(group): JobFailed ends the job on every rank at the same step, a write error happens after
        # the group is done with the job, and media that went bad (UsageError) before it is sent: either
        # way the workers are back waiting for a command. Any other exception from the group leaves it in
        # an unknown state and aborts the batch.
        video = None
        try:
            request = _request_to_run(item)
            if args.ext == "mp4":
                # Encoded piece by piece as the decode delivers them: overlapped with it, no whole video held.
                video = FileVideo(str(path), request)
                leader.generate(request, item.name, on_frames=video.write, on_audio=video.set_audio,
                                on_audio_piece=video.add_audio)
                video.close()
            else:
                result = leader.generate(request, item.name)
                write_output(result, f"{path}/" if args.ext == "frames" else path, item.request.fps)
            item.status, item.message = "ok", str(path)
        except (JobFailed, WriteError, UsageError) as exc:
            if video is not None:
                video.abort()
            item.status = "failed"
            item.message = f"generation failed: {exc}" if isinstance(exc, JobFailed) else str(exc)
            log.warning("line %d (%s): failed: %s", item.line, item.name, item.message)
        except BaseException:
            if video is not None:
                video.abort()  # nothing half-written is left under the output's hidden name
            raise
        item.seconds = time.perf_counter() - started


def run_batch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run ``cp-infer batch`` on this rank; returns the exit code (``UsageError`` for exit code 2)."""
    config = runtime_config_from_args(args, replicas=True)
    nproc = group_size(args.nproc)
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise UsageError(f"--out-dir {args.out_dir}: is a file, not a folder")
    quiet_libraries()
    check_device(config, nproc=nproc)
    info = model_info(config)
    check_stage_2_loras(config, info)
    check_vae_tiling(config, info)
    items = _plan_batch(args, info, config.limits) if int(os.environ.get("RANK", "0")) == 0 else []
    # Outside torchrun nothing is started when nothing is left to do. Under torchrun every rank must join
    # the group whatever the leader found (the workers cannot know), so the leader then just sends stop.
    if not in_torchrun() and not any(i.status == "todo" for i in items):
        return _summary(items)
    if not under_launcher():  # the launcher's own process fetched it for its ranks
        fetch_model(config)
    if nproc > 1 and not in_torchrun():
        # The layout for the lines to run, chosen here and handed to the ranks, which do not read the lines
        # (under a torchrun started by hand the workers cannot see them, so the default stays Ulysses over all).
        chosen = guidance_first(config, args, info, [i.request for i in items if i.status == "todo"])
        if chosen is not config:
            argv = [*argv, "--guidance-degree", str(chosen.guidance_degree),
                    "--ulysses-degree", str(chosen.ulysses_degree)]
        return relaunch_under_torchrun(nproc, argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    return run_group(config, lambda leader: _lead_batch(leader, items, args))

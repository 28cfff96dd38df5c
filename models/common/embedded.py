"""Shared machinery of the embedded default models ("tiny-ltx-video", "tiny-ltx2"): seeded weights and the
cache folder they are written to.

Invariants:
- `init_deterministic` makes weights a pure function of the seed and the parameter names and shapes: every
  parameter is overwritten in sorted-name order from one seeded generator, so torch's init code (and the
  caller's global RNG) play no part, and two builds are bitwise identical.
- One process builds a folder: `ensure_folder` holds an exclusive `flock` on a lock file beside it while it
  builds; the others wait on the lock, then find the folder built. The build goes to a private sibling folder
  renamed into place, so a half-written folder is never visible.
- The marker file (`MARKER_FILE`, written last, before the rename) lists every other file of the folder with its
  size and sha256. A folder counts as built only when its marker has the expected name and format version and
  every listed file has its recorded size and digest; one that fails (a file deleted, truncated or changed, or a
  marker from an older build) is rebuilt, with one warning naming the reason.
- Saving writes every component whatever process saves, also a rank other than 0 of an initialised
  torch.distributed group (`write_pipeline`, NOTE(save-rank)).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LTX_SCHEDULER_CONFIG",
    "CACHE_ENV", "LATENT_UPSAMPLER", "MARKER_FILE", "cache_root", "check_folder", "ensure_folder",
    "init_deterministic", "write_pipeline",
]

# The scheduler config LTX-Video 0.9.x (and LTX-2.0) ships: resolution-dependent ("dynamic") shift between
# base_shift at 1024 latent tokens and max_shift at 4096, with the schedule stretched to end at sigma 0.1.
LTX_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
)

log = logging.getLogger("cp_infer.models")

CACHE_ENV = "CP_INFER_CACHE"
MARKER_FILE = "cp_infer_default_model.json"
# A temporary build folder untouched for this long is one whose build died (a tiny model builds in under a second).
_STALE_AFTER_S = 3600.0
# The subfolder a model folder keeps its latent upsampler in (diffusers' layout, as in ``Lightricks/LTX-2``).
LATENT_UPSAMPLER = "latent_upsampler"


@torch.no_grad()
def init_deterministic(module: torch.nn.Module, seed: int, gains: Mapping[str, float] | None = None) -> None:
    """Overwrite every parameter from one generator, in sorted-name order.

    Scales keep activations O(1) so that outputs are neither vanishing nor saturated: matrices and conv
    kernels N(0, 1/fan_in); AdaLN `scale_shift_table`s N(0, 1/dim) as diffusers initialises them; 1-D
    weights (norm gains) 1 + N(0, 0.1^2); biases N(0, 0.05^2); then `gains[name]` multiplies.
    """
    gains = gains or {}
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        shape = tuple(param.shape)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("timestep_scale_multiplier"):
            # Maps the decode timestep in [0, 1] to the 0..1000 range the sinusoidal embedding expects.
            value = torch.full(shape, 1000.0)
        elif name.endswith("scale_shift_table"):
            value = noise / math.sqrt(shape[-1])
        elif len(shape) >= 2:
            value = noise / math.sqrt(math.prod(shape[1:]))
        elif name.endswith("bias"):
            value = 0.05 * noise
        elif len(shape) == 1:
            value = 1.0 + 0.1 * noise
        else:
            raise AssertionError(f"no init rule for parameter {name} of shape {shape}")
        param.copy_((gains.get(name, 1.0) * value).to(param.dtype))


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: `cache_dir`, else `$CP_INFER_CACHE`, else `~/.cache/cp-infer` (absolute)."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "cp-infer"
    return Path(cache_dir).expanduser().resolve()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under `folder` but the marker: path relative to `folder` -> {"size": bytes, "sha256": hex}."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return {rel: {"size": (folder / rel).stat().st_size, "sha256": _sha256(folder / rel)}
            for rel in files if rel != MARKER_FILE}


def check_folder(folder: Path, marker: Mapping[str, Any]) -> str | None:
    """Why `folder` is not a complete build of `marker` (e.g. "text_encoder/model.safetensors is missing"), or None
    when it is one: its marker file has `marker`'s keys and values, and every file the marker lists has the
    recorded size and sha256.

    Every call checks the digests too, sizes first (a missing or truncated file is named without reading the
    others): hashing the tiny models' 3-8 MB costs a few ms.
    """
    if not folder.is_dir():
        return "it is not a folder" if folder.exists() else "it does not exist"
    try:
        recorded = json.loads((folder / MARKER_FILE).read_text())
    except FileNotFoundError:
        return f"it has no {MARKER_FILE}"
    except (OSError, ValueError) as exc:
        return f"its {MARKER_FILE} is unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(recorded, dict):
        return f"its {MARKER_FILE} is not a JSON object"
    found = {key: recorded.get(key) for key in marker}
    if found != dict(marker):
        return f"its {MARKER_FILE} is for {found}, not {dict(marker)}"
    files = recorded.get("files")
    if not isinstance(files, dict) or not files:
        return f"its {MARKER_FILE} lists no files (an older cp-infer wrote it)"
    try:
        sizes = {rel: int(entry["size"]) for rel, entry in files.items()}
        digests = {rel: str(entry["sha256"]) for rel, entry in files.items()}
    except (KeyError, TypeError, ValueError):
        return f"its {MARKER_FILE} has a malformed file list"
    for rel, size in sizes.items():
        try:
            found_size = (folder / rel).stat().st_size
        except FileNotFoundError:
            return f"{rel} is missing"
        except OSError as exc:
            return f"{rel} is unreadable ({type(exc).__name__}: {exc})"
        if found_size != size:
            return f"{rel} has {found_size} bytes, its {MARKER_FILE} says {size}"
    for rel, digest in digests.items():
        try:
            if _sha256(folder / rel) != digest:
                return f"{rel} has changed since it was built (its sha256 is not the one {MARKER_FILE} records)"
        except OSError as exc:
            return f"{rel} is unreadable ({type(exc).__name__}: {exc})"
    return None


def _save_on_any_rank(is_main_process: bool) -> bool:
    return is_main_process


def write_pipeline(pipeline: Any, folder: Path) -> None:
    """Save a diffusers pipeline into `folder` (model_index.json + one subfolder per component), every component
    written whichever process calls this.

    NOTE(save-rank): transformers' `PreTrainedModel.save_pretrained` writes nothing on a process whose
    torch.distributed rank is not 0 (`should_save_on_this_rank`; passing `is_main_process=True` does not lift it),
    so a worker rank building a folder left text_encoder/ empty. An instance attribute lifts it for this call;
    diffusers' own `save_pretrained` has no rank check. Should a release change that, the check below fails the
    build instead of marking a folder with an empty component.
    """
    patched = [m for m in pipeline.components.values() if callable(getattr(m, "should_save_on_this_rank", None))]
    for module in patched:
        module.should_save_on_this_rank = _save_on_any_rank
    try:
        # Saving through the pipeline gives the same layout as a real checkpoint on the hub.
        pipeline.save_pretrained(folder, safe_serialization=True)
    finally:
        for module in patched:
            del module.should_save_on_this_rank
    index = json.loads((folder / "model_index.json").read_text())
    empty = [name for name, value in index.items()
             if not name.startswith("_") and isinstance(value, list) and value[0] is not None
             and not any(p.is_file() for p in (folder / name).rglob("*"))]
    if empty:
        raise RuntimeError(f"saving {type(pipeline).__name__} to {folder} wrote no files for "
                           f"{', '.join(name + '/' for name in empty)}")


def _write_marker(folder: Path, marker: Mapping[str, Any]) -> None:
    marker_file = folder / MARKER_FILE
    marker_file.write_text(json.dumps({**marker, "files": _manifest(folder)}, indent=2) + "\n")
    # The weight files come out 0600 (written via temporary files); give every file the mode a plain
    # write gets under the caller's umask, so a shared cache folder is readable by whoever may read it.
    mode = marker_file.stat().st_mode & 0o777
    for file in folder.rglob("*"):
        if file.is_file():
            file.chmod(mode)


def _lock(fd: int, target: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("waiting for another process to finish building %s", target)
        fcntl.flock(fd, fcntl.LOCK_EX)


def ensure_folder(target: Path, *, marker: Mapping[str, Any], write: Callable[[Path], None]) -> Path:
    """Return `target`, first (re)building it with `write(tmp_folder)` unless `check_folder` passes.

    Safe to call from many processes at once (e.g. every torchrun rank): the first to take the lock builds, the
    others wait for it, check again and use its folder. `marker` needs "name" and "format_version"; the marker
    file gets them and the list of files. A folder that fails the check is rebuilt when its marker file shows that
    it is ours; one without (a non-empty folder someone else put there) is refused.
    """
    problem = check_folder(target, marker)
    if problem is None:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # NOTE(lock-file): never deleted: a process that opened the old file and one that created a new one
        # would both hold "the" lock. The kernel drops a dead process's flock, so a crashed build blocks no one.
        fd = os.open(target.parent / f".{target.name}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise ValueError(f"{target} needs building ({problem}), but {exc}; set ${CACHE_ENV} to a writable "
                         "folder") from exc
    try:
        _lock(fd, target)
        problem = check_folder(target, marker)  # the process this one waited for may have built it
        if problem is not None:
            _build(target, marker, write, problem)
    finally:
        os.close(fd)  # releases the lock
    return target


def _build(target: Path, marker: Mapping[str, Any], write: Callable[[Path], None], problem: str) -> None:
    """Build `target` in a sibling folder and rename it into place; the caller holds the lock."""
    prefix = f".{target.name}.tmp-"
    # Left by builds that died. The age keeps a build by a process that takes no lock (an older cp-infer, whose
    # temporary folders had the same names) out of reach.
    for stale in target.parent.glob(prefix + "*"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > _STALE_AFTER_S:
                shutil.rmtree(stale, ignore_errors=True)
    replace = target.exists() and (not target.is_dir() or any(target.iterdir()))
    if replace:
        if not target.is_dir() or not (target / MARKER_FILE).exists():
            raise ValueError(
                f"{target} exists but is not a complete {marker['name']} v{marker['format_version']} build "
                f"({problem}), so it is not cp-infer's to replace; delete it and retry, or set ${CACHE_ENV} to "
                "another folder"
            )
        log.warning("rebuilding %s: %s", target, problem)
    tmp = target.parent / f"{prefix}{os.getpid()}-{uuid.uuid4().hex}"
    old = tmp.with_name(tmp.name + "-old")
    tmp.mkdir()
    try:
        write(tmp)
        _write_marker(tmp, marker)
        if replace:
            os.rename(target, old)
        try:
            # Atomic on POSIX, and replaces an empty target folder.
            os.rename(tmp, target)
        except OSError:
            # A process that takes no lock (an older cp-infer sharing the cache) got there first.
            if check_folder(target, marker) is not None:
                raise
    finally:
        for leftover in (tmp, old):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)

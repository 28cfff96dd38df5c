"""Shared machinery of the embedded default models ("tiny-ltx-video", "tiny-ltx2"): seeded weights and the
cache folder they are written to.

Invariants:
- `init_deterministic` makes weights a pure function of the seed and the parameter names and shapes: every
  parameter is overwritten in sorted-name order from one seeded generator, so torch's init code (and the
  caller's global RNG) play no part, and two builds are bitwise identical.
- `ensure_folder` never exposes a half-written folder: it builds in a private sibling folder and renames it
  into place, which is atomic; the marker file is written last, before the rename. A folder counts as built
  only when its marker equals the expected one, so a stale build (older format version) is never reused.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CACHE_ENV", "LATENT_UPSAMPLER", "MARKER_FILE", "cache_root", "ensure_folder", "init_deterministic",
    "write_pipeline",
]

CACHE_ENV = "CP_INFER_CACHE"
MARKER_FILE = "cp_infer_default_model.json"
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


def _is_complete(folder: Path, marker: Mapping[str, Any]) -> bool:
    try:
        return json.loads((folder / MARKER_FILE).read_text()) == dict(marker)
    except (OSError, ValueError):
        return False


def write_pipeline(pipeline: Any, folder: Path, marker: Mapping[str, Any]) -> None:
    """Save a diffusers pipeline into `folder` (model_index.json + one subfolder per component), marker last."""
    # Saving through the pipeline gives the same layout as a real checkpoint on the hub.
    pipeline.save_pretrained(folder, safe_serialization=True)
    marker_file = folder / MARKER_FILE
    marker_file.write_text(json.dumps(dict(marker), indent=2) + "\n")
    # The weight files come out 0600 (written via temporary files); give every file the mode a plain
    # write gets under the caller's umask, so a shared cache folder is readable by whoever may read it.
    mode = marker_file.stat().st_mode & 0o777
    for file in folder.rglob("*"):
        if file.is_file():
            file.chmod(mode)


def ensure_folder(target: Path, *, marker: Mapping[str, Any], write: Callable[[Path], None]) -> Path:
    """Return `target`, first building it with `write(tmp_folder)` unless it holds `marker` already.

    Safe to call from many processes at once (e.g. every torchrun rank): each builds into its own
    temporary sibling folder and renames it into place; a process that loses the race drops its copy and
    returns the winner's. `marker` needs "name" and "format_version" (they make the error message).
    """
    if _is_complete(target, marker):
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(
            f"{target} exists but is not a complete {marker['name']} v{marker['format_version']} build (missing "
            f"or stale {MARKER_FILE}); delete it and retry, or set ${CACHE_ENV} to another folder"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        write(tmp)
        try:
            # Atomic on POSIX; replaces an empty target folder, fails if another process got there first.
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, marker):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target

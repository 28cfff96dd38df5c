"""What is wrong with one component subfolder of a model folder, in words: the file that is missing, empty,
truncated, unreadable or not valid JSON. Used to explain a failed load; reads headers and JSON, never weights. Also
the error every model-loading module raises (`ModelLoadError`), defined here, below all of them.

Invariants:
- `component_problem` returns None when it finds nothing; it never raises for a bad file (that is what it reports).
- A safetensors file counts as truncated when it is shorter than its own header says (8-byte length, JSON header,
  then the tensors up to the largest end offset), so the check needs no tensor library.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["ModelLoadError", "component_problem", "error_line", "safetensors_problem"]

# Bigger than any real safetensors header (a few MB for thousands of tensors): a larger length is garbage.
_MAX_HEADER = 100 * 2**20


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the path, subfolder or hub id and the fix."""


def error_line(exc: BaseException) -> str:
    """`exc` as one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _safetensors_problem(path: Path, rel: str) -> str | None:
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            return f"{rel} is truncated ({size} bytes, shorter than a safetensors header)"
        (header_len,) = struct.unpack("<Q", head)
        if header_len > _MAX_HEADER:
            return f"{rel} is not a safetensors file (its header length reads {header_len} bytes)"
        if 8 + header_len > size:
            return f"{rel} is truncated ({size} bytes, its header alone is {8 + header_len})"
        try:
            header = json.loads(file.read(header_len))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                      default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            return f"{rel} has a malformed safetensors header ({error_line(exc)})"
    expected = 8 + header_len + int(end)
    if size < expected:
        return f"{rel} is truncated ({size} of the {expected} bytes its header describes)"
    if size > expected:
        return f"{rel} has {size - expected} bytes past the end its header describes"
    return None


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the safetensors file ``path`` (unreadable, truncated, not safetensors), or None."""
    try:
        return _safetensors_problem(path, str(path))
    except OSError as exc:
        return f"{path} is unreadable ({error_line(exc)})"


def _file_problem(path: Path, rel: str) -> str | None:
    try:
        with open(path, "rb") as file:
            file.read(1)
        if path.stat().st_size == 0:
            return f"{rel} is empty (0 bytes)"
        if path.name.endswith(".safetensors"):
            return _safetensors_problem(path, rel)
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text())
            except ValueError as exc:
                return f"{rel} is not valid JSON ({error_line(exc)})"
            if path.name.endswith(".index.json") and isinstance(data, dict):
                shards = sorted(set((data.get("weight_map") or {}).values()))
                missing = [s for s in shards if not (path.parent / s).is_file()]
                if missing:
                    return f"{rel} lists {', '.join(missing)}, which is missing"
    except OSError as exc:
        return f"{rel} is unreadable ({error_line(exc)})"
    return None


def component_problem(root: Path, subfolder: str, *, config: str | None = None, weights: bool = False) -> str | None:
    """What is wrong with `root/subfolder`: it is missing or empty, it lacks `config` (e.g. "config.json") or, when
    `weights`, a weights file, or one of its files is empty, truncated, unreadable or broken JSON. None if none."""
    folder = root / subfolder
    if not folder.is_dir():
        return f"{subfolder}/ is missing"
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        return f"{subfolder}/ is empty"
    for path in files:
        problem = _file_problem(path, path.relative_to(root).as_posix())
        if problem is not None:
            return problem
    if config is not None and not (folder / config).is_file():
        return f"{subfolder}/{config} is missing"
    if weights and not any(p.name.endswith((".safetensors", ".bin")) for p in files):
        return f"{subfolder}/ holds no weights file (no *.safetensors or *.bin)"
    return None

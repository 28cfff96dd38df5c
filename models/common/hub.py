"""Hugging Face Hub ids (``org/name[@revision]``) resolved to a snapshot folder of the hub cache, holding only the
files a diffusers folder loads.

Invariants:
- The cache, the offline switch and the token are huggingface_hub's own, read when a model is resolved: the cache is
  ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; ``HF_HUB_OFFLINE=1`` resolves from the
  cache alone; ``HF_TOKEN`` is what huggingface_hub sends.
- Only what a diffusers folder needs is fetched (:func:`needed_files`, from the repo's file list): ``model_index.json``
  and, in each component subfolder, its JSON configs, its safetensors weights and their index, its tokenizer files.
  Never pickle weights (``*.bin``, ``*.pt``, ...), never the single-file checkpoints Lightricks ship at a repo's root
  beside the diffusers folders, never a weights variant (``*.fp16.safetensors``) beside the plain weights.
- One process per node downloads: each takes an exclusive ``flock`` on ``<cache>/.locks/models--org--name/
  cp-infer.lock``. The first to get it downloads (huggingface_hub's progress bars); one that had to wait resolves
  from the cache without the network once the lock is free, and downloads only when the cache still lacks a file it
  needs (the other process failed, or fetched less).
- Every failure is a :class:`ModelLoadError` of one line naming the id and the fix: a missing or private repo, a
  gated one, a missing revision, an id not in the cache while offline, an incomplete cached snapshot, an unreachable
  hub, a repo that is not in diffusers format.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from models.common.folder_problems import ModelLoadError, error_line

__all__ = ["ALL_FILES", "FileSelection", "HubRef", "fetch", "hub_cache", "needed_files", "parse_hub_ref"]

log = logging.getLogger("cp_infer.models")

# A repo id as the hub spells them: one "org/name", letters, digits, "_", "-", ".", no "--" or "..".
_REPO_ID = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
# The files that make a top-level folder a component of a diffusers repo.
_COMPONENT_MARKERS = ("config.json", "scheduler_config.json", "tokenizer_config.json", "preprocessor_config.json",
                      "tokenizer.json")
# Vocabularies and chat templates beside a tokenizer's JSON files (SentencePiece, BPE merges, WordPiece, Gemma's).
_TOKENIZER_SUFFIXES = (".model", ".txt", ".jinja", ".tiktoken")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# diffusers / transformers weight names: name[.variant][-00001-of-00004].safetensors.
_WEIGHTS = re.compile(r"^[^.]+?(?:\.(?P<variant>[^.]+?))?(?:-\d{5}-of-\d{5})?\.safetensors$")
_PLAIN_INDEX = re.compile(r"^[^.]+\.safetensors\.index\.json$")
_LOCK_NAME = "cp-infer.lock"


@dataclass(frozen=True)
class HubRef:
    """A model repo on the hub, at a revision."""

    repo_id: str
    """``org/name``."""
    revision: str = "main"
    """A branch, tag or commit."""

    def __str__(self) -> str:
        return self.repo_id if self.revision == "main" else f"{self.repo_id}@{self.revision}"


def parse_hub_ref(text: str) -> HubRef | None:
    """``org/name`` or ``org/name@revision`` -> its :class:`HubRef`; None for anything else."""
    repo_id, at, revision = str(text).partition("@")
    if not _REPO_ID.match(repo_id) or (at and not revision.strip()) or any(c.isspace() for c in revision):
        return None
    return HubRef(repo_id, revision or "main")


@dataclass(frozen=True)
class FileSelection:
    """Which of a diffusers repo's files one use of it fetches."""

    weights: bool = True
    """False: configs and tokenizer files alone (enough to describe a model before loading it)."""
    skip_weights: frozenset[str] = frozenset()
    """Components whose weights come from elsewhere (a single-file checkpoint's transformer and VAE)."""
    only: frozenset[str] | None = None
    """These components alone (``{"latent_upsampler"}`` for a paired upsampler); None: every component."""


ALL_FILES = FileSelection()


def _variant(name: str) -> str | None:
    match = _WEIGHTS.match(name)
    return None if match is None else match.group("variant")


def _component_files(repo_id: str, component: str, names: list[str], selection: FileSelection) -> list[str]:
    """Of the file names directly inside one component folder (``"."``: the repo's root), those a load needs."""
    weights = [n for n in names if n.endswith(".safetensors")]
    plain = {n for n in weights if _WEIGHTS.match(n) and _variant(n) is None}
    pickles = [n for n in names if n.endswith(_PICKLE_SUFFIXES)]
    where = "its root" if component == "." else f"{component}/"
    wants_weights = selection.weights and component not in selection.skip_weights
    if wants_weights and weights and not plain:
        raise ModelLoadError(
            f"hub repo {repo_id!r}: {where} holds only variant weights ({', '.join(sorted(weights)[:2])}), which "
            "cp-infer does not load; use a revision with the plain *.safetensors weights")
    if wants_weights and not weights and pickles:
        raise ModelLoadError(
            f"hub repo {repo_id!r}: {where} holds its weights only as pickle ({', '.join(sorted(pickles)[:2])}), which "
            "cp-infer never loads (unpickling runs code); use a revision with *.safetensors weights")
    chosen = []
    for name in names:
        if name.endswith(".json"):
            # An index of pickle or of variant weights is as unwanted as those weights.
            if ".index" in name and not (wants_weights and _PLAIN_INDEX.match(name)):
                continue
            chosen.append(name)
        elif name.endswith(_TOKENIZER_SUFFIXES) or (wants_weights and name in plain):
            chosen.append(name)
    return chosen


def needed_files(repo_files: Iterable[str], selection: FileSelection = ALL_FILES, *, repo_id: str) -> list[str]:
    """The files of a diffusers repo (paths as the hub lists them) that loading it takes, sorted.

    A repo with ``model_index.json`` contributes it and its component folders (each top-level folder holding a
    config); one without, a single model at its root (``config.json`` and its weights, as a bare latent-upsampler
    repo ships). Raises :class:`ModelLoadError` for a repo that is neither, for a component whose weights are only
    pickle or only variants, and when ``selection.only`` names no component the repo has.
    """
    files = sorted({str(PurePosixPath(f)) for f in repo_files})
    by_folder: dict[str, list[str]] = {}
    for path in files:
        parts = path.split("/")
        if len(parts) == 2:
            by_folder.setdefault(parts[0], []).append(parts[1])
    components = {folder: names for folder, names in by_folder.items()
                  if any(marker in names for marker in _COMPONENT_MARKERS)}
    if selection.only is not None:
        components = {folder: names for folder, names in components.items() if folder in selection.only}
    if "model_index.json" in files and components:
        chosen = ["model_index.json"]
        for folder, names in sorted(components.items()):
            chosen += [f"{folder}/{name}" for name in _component_files(repo_id, folder, names, selection)]
        return chosen
    root = [f for f in files if "/" not in f]
    if "config.json" in root:
        # Root-level tokenizer-like files (a README.txt) are no part of a bare model.
        return [n for n in _component_files(repo_id, ".", root, selection) if not n.endswith(_TOKENIZER_SUFFIXES)]
    if selection.only is not None and "model_index.json" in files:
        raise ModelLoadError(f"hub repo {repo_id!r} has no {', '.join(sorted(selection.only))}/ folder (nor a "
                             "config.json at its root)")
    raise ModelLoadError(
        f"hub repo {repo_id!r} is not a diffusers-format model (no model_index.json with component folders, no "
        "config.json at its root); for a single-file checkpoint, download the file and pass --model FILE.safetensors "
        "--config with the diffusers repo or folder its configs come from")


def hub_cache() -> Path:
    """The hub cache folder, from the environment as it is now (huggingface_hub reads it once, at import)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache))).absolute()


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or flag.strip().upper() in ("1", "ON", "YES", "TRUE")


def fetch(ref: HubRef, selection: FileSelection = ALL_FILES) -> Path:
    """The snapshot folder of ``ref`` in the hub cache, holding the files ``selection`` names: from the cache when
    offline (or when another process just fetched them), else downloaded. Raises :class:`ModelLoadError`."""
    cache = hub_cache()
    if _offline():
        return _cached(ref, selection, cache, reason="HF_HUB_OFFLINE=1 keeps cp-infer from downloading it")
    lock = cache / ".locks" / f"models--{ref.repo_id.replace('/', '--')}" / _LOCK_NAME
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        # NOTE(lock-file): never deleted (as models.common.embedded's): a process that opened the old file and one that
        # created a new one would both hold "the" lock. The kernel drops a dead process's flock.
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise ModelLoadError(f"hub repo {str(ref)!r}: cannot use the hub cache {cache} ({error_line(exc)}); set "
                             "HF_HOME or HF_HUB_CACHE to a writable folder") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to download %s into %s", ref, cache)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                return _cached(ref, selection, cache, reason="")
            except ModelLoadError:
                pass  # the other process failed, or fetched less than this one needs
        return _download(ref, selection, cache)
    finally:
        os.close(fd)  # releases the lock


def _patterns(files: list[str]) -> list[str]:
    # Exact paths, escaped: huggingface_hub matches allow_patterns with fnmatch.
    return [glob.escape(f) for f in files]


def _cached(ref: HubRef, selection: FileSelection, cache: Path, *, reason: str) -> Path:
    """``ref``'s snapshot from the cache alone; the file list is the cached tree listing's when huggingface_hub
    recorded one (then every needed file must be there), else the snapshot is taken as it is."""
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        listed = [f.path for f in get_cached_repo_tree(ref.repo_id, revision=ref.revision, cache_dir=cache)]
        allow = _patterns(needed_files(listed, selection, repo_id=ref.repo_id))
    except CachedRepoTreeNotFoundError:
        allow = None
    try:
        path = Path(snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache, local_files_only=True,
                                      allow_patterns=allow))
    except IncompleteSnapshotError as exc:
        raise ModelLoadError(f"the cached snapshot of hub repo {str(ref)!r} in {cache} is incomplete "
                             f"({error_line(exc).split(': ', 1)[-1][:160]}); run once with HF_HUB_OFFLINE unset to "
                             "complete it") from exc
    except (LocalEntryNotFoundError, OSError) as exc:
        why = f" and {reason}" if reason else ""
        raise ModelLoadError(
            f"{str(ref)!r} is not a local path, and hub repo {ref.repo_id!r} (revision {ref.revision!r}) is not in "
            f"the hub cache {cache}{why}; run once with HF_HUB_OFFLINE unset to download it, or set HF_HOME / "
            "HF_HUB_CACHE to a cache that holds it") from exc
    if allow is None:
        needed_files([p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()], selection,
                     repo_id=ref.repo_id)  # raises for a snapshot that is no diffusers folder
    return path


def _download(ref: HubRef, selection: FileSelection, cache: Path) -> Path:
    from huggingface_hub import HfApi, snapshot_download

    try:
        info = HfApi().model_info(ref.repo_id, revision=ref.revision)
        files = needed_files([s.rfilename for s in info.siblings or ()], selection, repo_id=ref.repo_id)
        log.info("fetching %d file(s) of %s (commit %s) into %s", len(files), ref, info.sha, cache)
        return Path(snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache,
                                      allow_patterns=_patterns(files)))
    except ModelLoadError:
        raise
    # huggingface_hub raises its HTTP errors (OSError subclasses) and the HTTP client's own for a network that is
    # down; each is told apart below.
    except Exception as exc:
        error = _hub_error(ref, exc, cache)
        if error is not None:
            raise error from exc
        log.warning("could not reach the hub for %s (%s); using the hub cache", ref, error_line(exc))
        try:
            return _cached(ref, selection, cache, reason="")
        except ModelLoadError as cached_exc:
            raise ModelLoadError(
                f"could not reach the Hugging Face Hub for {str(ref)!r} ({error_line(exc)}), and it is not in the "
                f"hub cache {cache}; check the network (and HF_ENDPOINT), or set HF_HOME / HF_HUB_CACHE to a cache "
                "that holds it") from cached_exc


def _hub_error(ref: HubRef, exc: Exception, cache: Path) -> ModelLoadError | None:
    """The one-line error for a hub answer; None for a network that did not answer (the cache may still serve)."""
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo = ref.repo_id
    if isinstance(exc, GatedRepoError):
        return ModelLoadError(f"hub repo {repo!r} is gated: accept its conditions at https://huggingface.co/{repo} "
                              "while logged in, then set HF_TOKEN to a token of that account")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelLoadError(
            f"{str(ref)!r} is not a local path, and the Hugging Face Hub has no model repo {repo!r} (or it is private "
            "and HF_TOKEN is unset or cannot read it); check the id, or set HF_TOKEN to a token with access")
    if isinstance(exc, RevisionNotFoundError):
        return ModelLoadError(f"hub repo {repo!r} has no revision {ref.revision!r}; name one of its branches, tags "
                              f"or commits ({repo}@main, {repo}@<commit>)")
    if isinstance(exc, DisabledRepoError):
        return ModelLoadError(f"hub repo {repo!r} is disabled on the Hugging Face Hub; use another repo")
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return ModelLoadError(f"the Hugging Face Hub refused access to {repo!r} (HTTP {status}); set HF_TOKEN to "
                                  "a valid token with access to it")
        if status is not None and status < 500:
            return ModelLoadError(f"the Hugging Face Hub answered HTTP {status} for {str(ref)!r} "
                                  f"({error_line(exc)}); check the id and revision")
        return None  # the hub is down: the cache may still serve
    if isinstance(exc, (ValueError, OSError)) and not _is_network_error(exc):
        return ModelLoadError(f"could not fetch hub repo {str(ref)!r} into {cache}: {error_line(exc)}")
    return None


def _is_network_error(exc: Exception) -> bool:
    """A request that got no answer: huggingface_hub's HTTP client's transport errors, or the OS's."""
    client = sys.modules.get("httpx2") or sys.modules.get("httpx")
    transport = getattr(client, "TransportError", ()) if client is not None else ()
    return isinstance(exc, (ConnectionError, TimeoutError, *([transport] if transport else [])))

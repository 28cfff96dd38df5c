"""Building an embedded model folder: one process builds it, whatever rank it is in a process group, and a folder
whose files no longer match its marker is rebuilt."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import models.ltx2.default as default_ltx2
from models.common.embedded import MARKER_FILE, cache_root, check_folder
from models.ltx2.default import default_ltx2_model_dir, ensure_default_ltx2_model
from models.ltx2.loading import load_ltx2

from ..worker_groups import SharedGroup


def _components(folder: Path) -> list[str]:
    index = json.loads((folder / "model_index.json").read_text())
    return [name for name, value in index.items() if not name.startswith("_") and value[0] is not None]


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MARKER_FILE}


def _assert_complete(folder: Path) -> None:
    components = _components(folder)
    assert "text_encoder" in components and len(components) == 8
    for name in components:
        assert any((folder / name).iterdir()), f"{name}/ is empty"
    assert {"text_encoder/model.safetensors", "text_encoder/config.json"} <= _files(folder)
    marker = json.loads((folder / MARKER_FILE).read_text())
    assert set(marker["files"]) == _files(folder), "the marker does not list every file"
    assert check_folder(folder, {"name": "tiny-ltx2", "format_version": marker["format_version"]}) is None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_default_ltx2_model(tmp_path_factory.mktemp("cache"))


def _build_in_group(state, cache: str, first: int | None) -> str:
    # Ranks other than `first` wait until it has built; with first=None all ranks race from a barrier.
    import torch.distributed as dist

    assert dist.is_initialized() and dist.get_world_size() == 2
    if first is not None and dist.get_rank() != first or first is None:
        dist.barrier()
    path = ensure_default_ltx2_model(cache)
    if first is not None and dist.get_rank() == first:
        dist.barrier()
    return str(path)


@pytest.mark.timeout(300)
def test_a_worker_rank_builds_a_complete_folder(tmp_path):
    # transformers' save_pretrained writes nothing on a rank other than 0 of an initialised process group: a
    # worker rank that builds the folder must still write text_encoder/.
    group = SharedGroup(2)
    alone = group.run(_build_in_group, str(tmp_path / "rank1"), 1)
    raced = group.run(_build_in_group, str(tmp_path / "race"), None)
    for cache, paths in (("rank1", alone), ("race", raced)):
        folder = default_ltx2_model_dir(tmp_path / cache)
        assert paths == [str(folder)] * 2
        _assert_complete(folder)
        assert [p.name for p in (tmp_path / cache).iterdir() if ".tmp-" in p.name] == [], "temp folder left"
    load_ltx2(default_ltx2_model_dir(tmp_path / "rank1"))


@pytest.mark.parametrize("damage", ["delete", "truncate", "empty_text_encoder", "legacy_marker"])
def test_a_broken_folder_is_rebuilt(model_dir, tmp_path, damage, caplog):
    folder = Path(shutil.copytree(model_dir, default_ltx2_model_dir(tmp_path)))
    weights = folder / "text_encoder" / "model.safetensors"
    if damage == "delete":
        weights.unlink()
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    else:
        # What the issue found in a user's cache: marked complete by an older build, text_encoder/ empty.
        shutil.rmtree(folder / "text_encoder")
        (folder / "text_encoder").mkdir()
        if damage == "legacy_marker":
            marker = json.loads((folder / MARKER_FILE).read_text())
            (folder / MARKER_FILE).write_text(json.dumps({k: marker[k] for k in ("name", "format_version")}))
    with caplog.at_level(logging.WARNING, logger="cp_infer.models"):
        assert ensure_default_ltx2_model(tmp_path) == folder
    (record,) = [r for r in caplog.records if r.name == "cp_infer.models"]
    message = record.getMessage()
    assert "rebuilding" in message and str(folder) in message and "\n" not in message
    expected = {"delete": "text_encoder/model.safetensors is missing", "truncate": "text_encoder/model.safetensors has",
                "empty_text_encoder": "text_encoder/", "legacy_marker": "lists no files"}[damage]
    assert expected in message
    _assert_complete(folder)
    assert weights.read_bytes() == (model_dir / "text_encoder" / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [folder.name]
    load_ltx2(folder)


def test_a_changed_file_of_the_same_size_is_found(model_dir, tmp_path):
    folder = Path(shutil.copytree(model_dir, default_ltx2_model_dir(tmp_path)))
    weights = folder / "text_encoder" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    marker = json.loads((folder / MARKER_FILE).read_text())
    problem = check_folder(folder, {k: marker[k] for k in ("name", "format_version")})
    assert problem is not None and "text_encoder/model.safetensors" in problem and "sha256" in problem
    ensure_default_ltx2_model(tmp_path)
    assert weights.read_bytes() == (model_dir / "text_encoder" / "model.safetensors").read_bytes()


def test_a_waiting_process_uses_the_folder_the_builder_made(model_dir, tmp_path, monkeypatch):
    folder = default_ltx2_model_dir(tmp_path)

    def must_not_build(_folder):
        raise AssertionError("built although another process had built the folder while this one waited")

    monkeypatch.setattr(default_ltx2, "_write_model", must_not_build)
    tmp_path.mkdir(exist_ok=True)
    # flock locks conflict between open file descriptions, so this descriptor stands in for another process.
    with open(tmp_path / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = []
        waiter = threading.Thread(target=lambda: result.append(ensure_default_ltx2_model(tmp_path)), daemon=True)
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive(), "did not wait for the lock holder"
        shutil.copytree(model_dir, tmp_path / "staging")
        (tmp_path / "staging").rename(folder)
    waiter.join(timeout=30)
    assert result == [folder]


def test_the_tests_build_in_their_own_cache():
    # tests/conftest.py: no test builds (or breaks) a model in the user's cache, nor reaches the hub.
    assert cache_root() != (Path.home() / ".cache" / "cp-infer").resolve()
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['CP_INFER_CACHE'])"],
                           capture_output=True, text=True, check=True)
    assert Path(child.stdout.strip()).resolve() == cache_root()


def test_a_dead_build_s_temporary_folder_is_removed(tmp_path):
    folder = default_ltx2_model_dir(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    dead, recent = tmp_path / f".{folder.name}.tmp-1-dead", tmp_path / f".{folder.name}.tmp-2-recent"
    for leftover in (dead, recent):
        (leftover / "text_encoder").mkdir(parents=True)
    os.utime(dead, (time.time() - 2 * 3600,) * 2)
    ensure_default_ltx2_model(tmp_path)
    # The recent one may be a live build by a process that takes no lock: it stays.
    assert not dead.exists() and recent.exists()

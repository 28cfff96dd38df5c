"""A real ``cp-infer serve`` (a torchrun group on CPU with the embedded default model) for the server tests.

``ServerProcess`` launches ``python -m server.cli serve --nproc 2 ...`` as a subprocess in a session of its own,
waits for ``/ready`` and, at teardown, stops every process it started: the CLI, torchrun (which the CLI starts
in another session) and the ranks, found by walking ``/proc`` for descendants and reading ``group.json``.

One server is shared by the e2e, fault, bad-input, LoRA and playground modules (``api_server``, session-scoped: a
start costs ~15-30 s on two cores); the restart and torchrun modules start their own, because they kill them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.harness import free_port

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key-0123456789abcdef"
# Faults by prompt marker (see server/group/runtime.py FaultRule): each test names the one it wants in its prompt.
API_FAULTS = ";".join([
    "rank=1,step=1,kind=raise,prompt=[fault:rank1-raise]",
    "rank=0,step=decode,kind=raise,prompt=[fault:rank0-decode]",
    "step=1,kind=oom,prompt=[fault:oom]",  # torch.OutOfMemoryError from the transformer on both ranks, in step 1
    "rank=0,kind=sleep,seconds=0.25,prompt=[slow]",
    # After each decoded piece reaches rank 0 (and is encoded): a streamed job's bytes are out while it decodes.
    "rank=0,step=decode,kind=sleep,seconds=1,prompt=[slow-decode]",
])
# Small limits so that every limit can be hit with a small body.
API_ARGS = ["--max-queue", "3", "--max-prompt-chars", "300", "--max-tokens", "512", "--max-frames", "65",
            "--max-side", "512", "--max-steps", "50", "--max-guidance", "20", "--max-fps", "60", "--keep-frames",
            "--max-body-bytes", "16384", "--max-upload-bytes", "200000", "--heartbeat-s", "0.5",
            "--collective-timeout", "30"]


def tiny(prompt: str = "a red fox runs through fresh snow", **overrides) -> dict:
    body = {"prompt": prompt, "num_frames": 9, "size": "96x64", "num_inference_steps": 2, "seed": 1234}
    body.update(overrides)
    return body


def mp4_bytes(frames: np.ndarray) -> bytes:
    """An H.264 MP4 of uint8 frames [F, H, W, 3] at 24 fps, near-lossless (crf 10), as a client uploads it."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"crf": "10"}
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def lossless_frames(server, job_id: str) -> np.ndarray:
    """A completed job's frames as the server kept them (``variant=frames``: ``--keep-frames``)."""
    r = server.client.get(f"/v1/videos/{job_id}/content", params={"variant": "frames"})
    assert r.status_code == 200, r.text
    return np.load(io.BytesIO(r.content))


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class ServerProcess:
    def __init__(self, workdir: Path, cache_dir: Path, *, extra_args: list[str], faults: str = "",
                 nproc: int = 2, api_key: str | None = API_KEY, under_torchrun: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = workdir / "data"
        self.log_path = workdir / "server.log"
        self.api_key = api_key
        serve = ["-m", "server.cli", "serve", "--port", str(self.port), "--data-dir", str(self.data_dir), *extra_args]
        if under_torchrun:  # torchrun itself, as a user would start it
            args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *serve]
        else:
            args = [sys.executable, *serve, "--nproc", str(nproc)]
        if api_key:
            args += ["--api-key", api_key]
        env = dict(os.environ, CP_INFER_CACHE=str(cache_dir), PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        env.pop("CP_INFER_TEST_FAULT", None)
        if faults:
            env["CP_INFER_TEST_FAULT"] = faults
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._seen: set[int] = set()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=60.0)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def group(self) -> dict:
        return json.loads((self.data_dir / "group.json").read_text())

    def wait_ready(self, timeout: float = 240.0, *, restart_count: int | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._seen.update(descendants(self.proc.pid))
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if self.client.get("/ready", timeout=5).status_code == 200 and (
                        restart_count is None or self.group()["restart_count"] == restart_count):
                    self._seen.update(self.group()["pids"])
                    return
            time.sleep(0.3)
        pytest.fail(f"the server was not ready after {timeout} s:\n{self.log_tail()}")

    def wait_job(self, job_id: str, timeout: float = 120.0, statuses=("completed", "failed", "cancelled")) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.client.get(f"/v1/videos/{job_id}")
            assert r.status_code == 200, r.text
            if r.json()["status"] in statuses:
                return r.json()
            time.sleep(0.1)
        pytest.fail(f"job {job_id} did not reach {statuses} in {timeout} s: {r.json()}\n{self.log_tail()}")

    def submit(self, body: dict) -> dict:
        r = self.client.post("/v1/videos", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def metric(self, name: str) -> float:
        """One sample of /metrics, by its full name with labels, e.g. ``cp_infer_jobs{state="queued"}``."""
        text = self.client.get("/metrics").text
        for line in text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == name:
                return float(value)
        raise KeyError(f"{name} not in /metrics:\n{text}")

    def stop(self) -> None:
        self.client.close()
        self._seen.update(descendants(self.proc.pid))
        with contextlib.suppress(Exception):
            self._seen.update(self.group()["pids"])
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the CLI forwards it to torchrun, which stops the ranks
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        for pid in [self.proc.pid, *self._seen]:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The default model, built once here so that the servers' ranks only load it."""
    from models.ltx_video.default import ensure_default_model

    path = tmp_path_factory.mktemp("cp_infer_cache")
    ensure_default_model(path)
    return path


@pytest.fixture(scope="session")
def api_server(tmp_path_factory, cache_dir):
    workdir = tmp_path_factory.mktemp("api_server")
    # An adapter directory, empty at the start: the LoRA tests place their adapters there (a server reads it per
    # request), so the shared server serves them without a start of its own.
    lora_dir = workdir / "loras"
    lora_dir.mkdir()
    server = ServerProcess(workdir, cache_dir, extra_args=[*API_ARGS, "--lora-dir", str(lora_dir)],
                           faults=API_FAULTS)
    server.lora_dir = lora_dir
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()

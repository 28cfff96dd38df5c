"""``cp-infer generate --out -``: a fragmented MP4 on stdout, at 1 rank and at 2 (through torchrun), with every log
line and the progress bar on stderr. Stdout must be the MP4 and nothing else: its top-level boxes tile it exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from cp_infer.video_io import read_mp4
from models.ltx_video.default import ensure_default_model

from .commands import Commands, cli_env

ARGS = ["generate", "--prompt", "a fox in snow", "--frames", "17", "--height", "64", "--width", "96", "--steps", "2",
        "--fps", "12", "--seed", "7", "--out", "-"]


def _boxes(data: bytes) -> list[bytes]:
    """The MP4's top-level box types; fails unless the boxes cover ``data`` exactly (no stray bytes anywhere)."""
    types, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        assert size >= 8 and at + size <= len(data), f"no MP4 box at byte {at} of {len(data)}: {data[at:at + 16]!r}"
        types.append(data[at + 4:at + 8])
        at += size
    return types


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("cache")
    ensure_default_model(cache)
    env = cli_env(cache)
    # A tee or a rank filter left in the environment must not reach the video (the relaunch overrides them).
    env.update(PET_TEE="3", PET_LOCAL_RANKS_FILTER="1")
    return env


@pytest.mark.timeout(400)
def test_generate_to_stdout_one_and_two_ranks(env, tmp_path):
    videos = {}
    with Commands({f"{nproc}": [*ARGS, "--nproc", str(nproc)] for nproc in (1, 2)}, env=env, cwd=tmp_path,
                  text=False, check=True, timeout=180) as commands:
        procs = {nproc: commands.result(f"{nproc}") for nproc in (1, 2)}
    for nproc, proc in procs.items():
        err = proc.stderr.decode(errors="replace")
        boxes = _boxes(proc.stdout)
        assert boxes[:2] == [b"ftyp", b"moov"] and b"moof" in boxes and b"mdat" in boxes, boxes[:6]
        (tmp_path / f"{nproc}.mp4").write_bytes(proc.stdout)
        videos[nproc], fps = read_mp4(tmp_path / f"{nproc}.mp4")
        assert videos[nproc].shape == (17, 64, 96, 3) and fps == 12 and videos[nproc].std() > 1
        assert f"wrote stdout (17 frames, 96x64 @ 12 fps, fragmented MP4; {nproc} rank(s)" in err
        assert "2/2" in err  # the progress bar
    # The same request at 1 and 2 ranks: the same video, within compression noise (another video: ~50 levels).
    error = np.abs(videos[1].astype(np.int16) - videos[2].astype(np.int16))
    assert error.mean() < 8, error.mean()

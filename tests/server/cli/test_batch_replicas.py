"""``cp-infer batch --nproc 2 --ulysses-degree 1``: two replica groups of one rank, each running the next line of
the prompts file as soon as it is free; every output equals the one-group run's."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from cp_infer.video_io import read_frames_dir
from models.ltx_video.default import ensure_default_model

from .commands import Commands, cli_env

LINES = [{"prompt": f"a paper boat on a stream, take {i}", "seed": 40 + i} for i in range(4)]
DEFAULTS = ["--frames", "9", "--height", "64", "--width", "96", "--steps", "2", "--ext", "frames"]


def _batch(name: str, *flags: str) -> list[str]:
    return ["batch", "{root}/prompts.jsonl", "--out-dir", f"{{root}}/{name}", *DEFAULTS, *flags]


@pytest.mark.timeout(400)
def test_batch_on_two_replicas_runs_lines_on_both_and_equals_one_group(tmp_path):
    cache = tmp_path / "cache"
    ensure_default_model(cache)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES))
    with Commands({"replicas": _batch("replicas", "--nproc", "2", "--ulysses-degree", "1"),
                   "one": _batch("one", "--nproc", "2", "--guidance-degree", "1")},  # one group of two ranks (U=2)
                  env=cli_env(cache), cwd=tmp_path, fields=dict(root=tmp_path), check=True, timeout=240) as commands:
        replicas = commands.result("replicas")
        commands.result("one")
    ran_on = {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"line (\d+) \(\S+\) runs on replica (\d)",
                                                                     replicas.stderr)}
    assert sorted(ran_on) == [1, 2, 3, 4] and set(ran_on.values()) == {0, 1}, replicas.stderr[-3000:]
    assert "4 ok" in replicas.stdout
    for line in range(1, 5):
        a = read_frames_dir(tmp_path / "replicas" / f"{line:05d}")[0]
        b = read_frames_dir(tmp_path / "one" / f"{line:05d}")[0]
        assert a.shape == (9, 64, 96, 3) and a.std() > 5
        diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < 0.01, (line, diff.max(), diff.mean())


def test_generate_refuses_replicas(tmp_path, capsys):
    from server.cli import command as cli

    code = cli.main(["generate", "--prompt", "a fox", "--nproc", "2", "--ulysses-degree", "1", "--out",
                     str(tmp_path / "x.mp4")])
    err = capsys.readouterr().err
    assert code == 2 and "2 replica groups" in err and "`cp-infer serve` and `batch` do" in err, err

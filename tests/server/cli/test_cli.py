"""``cp-infer generate`` and ``batch`` as real processes (1 rank, and 2 ranks through torchrun) on the tiny model.

Process start-up (imports, torchrun) dominates, so every command runs once per module and the tests share its
outputs.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cp_infer import VideoGeometry
from cp_infer.request import GenerationLimits, resolve_request
from cp_infer.sampler import JobFailed
from cp_infer.video_io import read_frames_dir, read_mp4, write_mp4
from models.ltx_video.default import ensure_default_model
from models.registry import ModelInfo, model_options
from server.cli import batch
from server.cli import command as cli
from server.cli.launch import leader_exit_code, strip_nproc
from server.cli.lead import Generated

from .commands import Commands, cli_env

PROMPT = ["--prompt", "a fox in snow"]
SHAPE = ["--frames", "17", "--height", "64", "--width", "96", "--steps", "2", "--fps", "12", "--seed", "7"]
BATCH_LINES = [
    json.dumps({"prompt": "a red fox", "name": "fox", "frames": 9, "fps": 8}),
    '{"prompt": "a cat", "frames": ',
    json.dumps({"prompt": "a dog", "num_frames": 40}),
    json.dumps({"prompt": "a whale", "steps": 2, "seed": 3}),
]
BATCH_DEFAULTS = ["--height", "64", "--width", "96", "--steps", "2", "--frames", "17"]


COMMANDS = {
    "mp4-1": ("generate", *PROMPT, *SHAPE, "--nproc", "1", "--out", "{out}/mp4-1/clip.mp4"),
    # With a step cache (no other test compares its frames): at threshold 1.0 step 1 reuses step 0's cached tail.
    "mp4-2": ("generate", *PROMPT, *SHAPE, "--nproc", "2", "--cache", "first_block", "--cache-threshold", "1.0",
              "--out", "{out}/mp4-2/clip.mp4"),
    "frames-1": ("generate", *PROMPT, *SHAPE, "--out", "{out}/frames-1/"),
    "frames-2": ("generate", *PROMPT, *SHAPE, "--nproc", "2", "--out", "{out}/frames-2/"),  # the default: G=2
    "frames-u2": ("generate", *PROMPT, *SHAPE, "--nproc", "2", "--guidance-degree", "1", "--out", "{out}/frames-u2/"),
    "batch": ("batch", "{out}/prompts.jsonl", "--out-dir", "{out}/batch", *BATCH_DEFAULTS),
}


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("out")


@pytest.fixture(scope="module")
def commands(tmp_path_factory, out):
    cache = tmp_path_factory.mktemp("cache")
    ensure_default_model(cache)  # once, here, rather than racing in the first command
    (out / "prompts.jsonl").write_text("\n".join(BATCH_LINES) + "\n")
    commands = Commands(COMMANDS, env=cli_env(cache), cwd=tmp_path_factory.mktemp("cwd"), fields=dict(out=out),
                        timeout=150)
    yield commands
    commands.close()


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [1, 2])
def test_generate_mp4(commands, out, nproc):
    proc = _ok(commands.result(f"mp4-{nproc}"))
    frames, fps = read_mp4(out / f"mp4-{nproc}" / "clip.mp4")
    assert frames.shape == (17, 64, 96, 3)
    assert fps == 12
    assert frames.std() > 1, "decoded frames are flat: the video holds no picture"
    # The leader alone prints the result line; the bar shows the steps, then the decode.
    assert proc.stdout.count("wrote ") == 1 and f"{nproc} rank(s)" in proc.stdout
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("wrote ")]
    if nproc == 1:  # no cache: the line says nothing of one
        assert re.search(r"1 rank\(s\); load \d+\.\d s, generate ", line), line
    else:  # first_block over CFG's pair on both guidance ranks: every rank's totals, agreed, reach the line
        assert re.search(r"2 rank\(s\); 1 step computed, 1 skipped; load \d+\.\d s, generate ", line), line
    assert "2/2" in proc.stderr and "[decode]" in proc.stderr


@pytest.mark.timeout(300)
def test_generate_frames_two_ranks_match_one(commands, out):
    """``--guidance-degree 1`` on 2 ranks: Ulysses over both (each pass's tokens sharded), same video."""
    frames = {}
    for nproc, key in ((1, "frames-1"), (2, "frames-u2")):
        proc = _ok(commands.result(key))
        frames[nproc], fps = read_frames_dir(out / key)
        assert fps == 12 and frames[nproc].shape == (17, 64, 96, 3)
    assert "guidance 1 x Ulysses 2" in proc.stderr, proc.stderr[-2000:]
    # Ulysses attention reorders floating-point sums, so pixels may round to a neighbouring level (never more).
    diff = np.abs(frames[1].astype(np.int16) - frames[2].astype(np.int16))
    assert diff.max() <= 1, diff.max()
    # The MP4 of the same request holds the same video: it decodes like these frames encoded here. (The tiny
    # model's frames are near pixel noise, which yuv420p cannot keep, so compare against an encode, not the
    # PNGs: two encodes differ by a few levels on average, two different videos by ~50.)
    _ok(commands.result("mp4-1"))
    write_mp4(frames[1], out / "reference.mp4", fps=12)
    reference = read_mp4(out / "reference.mp4")[0].astype(np.int16)
    error = np.abs(read_mp4(out / "mp4-1" / "clip.mp4")[0].astype(np.int16) - reference)
    assert error.mean() < 8, error.mean()


@pytest.fixture
def nothing_starts(monkeypatch, commands):
    """In-process ``cli.main`` where starting a group or loading a model fails the test."""
    import server.group.runtime

    monkeypatch.setenv("CP_INFER_CACHE", commands.env["CP_INFER_CACHE"])
    def forbidden(*_args, **_kwargs):
        raise AssertionError("a bad request must be refused before anything starts")

    monkeypatch.setattr(cli, "relaunch_under_torchrun", forbidden)
    monkeypatch.setattr(server.group.runtime, "start_runtime", forbidden)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for name in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        monkeypatch.setenv(name, "error")  # main() sets them; monkeypatch puts the old values back


@pytest.mark.timeout(300)
def test_generate_default_layout_spreads_cfg_and_matches_one_rank(commands, out):
    """No degree given, CFG on, 2 ranks: the command takes guidance 2 x Ulysses 1 (CFG's two passes one per rank,
    exchanged each step), and the video is the one rank's."""
    frames = {}
    for key in ("frames-1", "frames-2"):
        proc = _ok(commands.result(key))
        frames[key], _fps = read_frames_dir(out / key)
    assert "guidance 2 x Ulysses 1" in proc.stderr, proc.stderr[-2000:]
    assert frames["frames-1"].std() > 1
    diff = np.abs(frames["frames-1"].astype(np.int16) - frames["frames-2"].astype(np.int16))
    assert frames["frames-2"].shape == frames["frames-1"].shape and diff.max() <= 1, diff.max()


@pytest.mark.parametrize(("flags", "expected"), [
    ([], (2, 1)),  # CFG's pair: one guidance rank each
    (["--guidance-scale", "1"], (1, 2)),  # one pass a step: Ulysses over both
    (["--guidance-degree", "1"], (1, None)),  # given: kept as given
    (["--ulysses-degree", "2"], (None, 2)),
    (["--ring-degree", "2"], (1, 1)),  # a ring of both ranks: no rank left for guidance
])
def test_generate_layout_follows_the_request_unless_given(nothing_starts, flags, expected):
    from server.cli.common import guidance_first, model_info, request_from_args, runtime_config_from_args

    argv = ["generate", *PROMPT, "--nproc", "2", *flags, "--out", "x.mp4"]
    args = cli.build_parser(argv).parse_args(argv)
    config = runtime_config_from_args(args)
    info = model_info(config)
    request = resolve_request(request_from_args(args, info.options, prompt=args.prompt, seed=args.seed),
                              info.options)
    chosen = guidance_first(config, args, info, [request])
    assert (chosen.guidance_degree, chosen.ulysses_degree) == expected
    assert chosen.ring_degree == args.ring_degree


@pytest.mark.parametrize(("model", "node", "expected"), [
    ([], None, (2, 1)),  # tiny-ltx-video's 4 heads divide 2: Ulysses over both
    ([], "1", (1, 2)),  # one rank a node: the ring crosses the nodes
    (["--model", "tiny-wan"], None, (1, 2)),  # 5 heads: a ring of two, no padded head
])
def test_auto_ring_degree_from_the_heads_and_the_node(nothing_starts, monkeypatch, model, node, expected):
    from server.cli.common import runtime_config_from_args

    if node is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", node)
    argv = ["generate", *PROMPT, *model, "--nproc", "2", "--ring-degree", "auto", "--out", "x.mp4"]
    config = runtime_config_from_args(cli.build_parser(argv).parse_args(argv))
    assert (config.ulysses_degree, config.ring_degree) == expected
    argv = ["generate", *PROMPT, "--nproc", "2", "--ring-degree", "auto", "--ulysses-degree", "1", "--out", "x.mp4"]
    with pytest.raises(ValueError, match="--ring-degree auto picks the Ulysses degree too"):
        runtime_config_from_args(cli.build_parser(argv).parse_args(argv))


@pytest.mark.parametrize(("lines", "handed"), [
    ([{"prompt": "a fox"}, {"prompt": "a cat", "seed": 3}], ["--guidance-degree", "2", "--ulysses-degree", "1"]),
    ([{"prompt": "a fox"}, {"prompt": "a cat", "guidance_scale": 1.0}], ["--guidance-degree", "1", "--ulysses-degree",
                                                                         "2"]),
])
def test_batch_hands_the_ranks_the_layout_of_its_lines(nothing_starts, monkeypatch, tmp_path, lines, handed):
    """The launcher reads the lines, the ranks do not: it picks the layout for every line to run (one without CFG
    makes it Ulysses over all) and passes it on the ranks' command line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    seen = []
    monkeypatch.setattr(batch, "relaunch_under_torchrun", lambda nproc, argv: seen.append((nproc, argv)) or 0)
    argv = ["batch", str(prompts), "--out-dir", str(tmp_path / "o"), "--nproc", "2"]
    assert cli.main(argv) == 0
    assert seen == [(2, [*argv, *handed])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [["--guidance-degree", "3"], ["--ulysses-degree", "1"],
                                   ["--guidance-degree", "2", "--ulysses-degree", "2"]], ids=["G3", "U1", "G2xU2"])
def test_generate_layout_that_is_not_the_group_exits_2_before_starting(nothing_starts, tmp_path, capsys, flags):
    out = tmp_path / "x.mp4"
    code = cli.main(["generate", "--prompt", "a fox", *flags, "--nproc", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "does not" in err and "--guidance-degree 1 --ulysses-degree 2, --guidance-degree 2 --ulysses-degree 1" \
        in err and "Traceback" not in err, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("flags", "fix"), [
    (["--ring-degree", "3"], "--ring-degree must divide the 2 ranks: one of [2]"),
    (["--ring-degree", "2", "--ulysses-degree", "2"], "--guidance-degree 1 --ring-degree 2 --ulysses-degree 1"),
], ids=["R3", "R2xU2"])
def test_generate_ring_layout_that_is_not_the_group_exits_2_naming_the_fix(nothing_starts, tmp_path, capsys, flags,
                                                                           fix):
    out = tmp_path / "x.mp4"
    code = cli.main(["generate", "--prompt", "a fox", *flags, "--nproc", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "does not divide" in err and fix in err and "Traceback" not in err, err


@pytest.mark.timeout(120)
def test_generate_bad_frames_exits_2_before_starting(nothing_starts, tmp_path, capsys):
    out = tmp_path / "bad.mp4"
    code = cli.main(["generate", "--prompt", "a fox", "--frames", "40", "--nproc", "2", "--out", str(out)])
    assert code == 2
    assert "--frames: num_frames=40 is not 8k+1" in capsys.readouterr().err and not out.exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [["--stg", "1"], ["--stg-blocks", "0,1"], ["--audio-guidance", "5"]],
                         ids=["stg", "stg-blocks", "audio-guidance"])
def test_generate_ltx2_option_on_ltx_video_exits_2_before_starting(nothing_starts, tmp_path, capsys, flags):
    out = tmp_path / "x.mp4"
    code = cli.main(["generate", "--prompt", "a fox", *flags, "--nproc", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert f"error: {flags[0]}: not an option of LTX-Video models" in err and "Traceback" not in err, err


@pytest.mark.timeout(120)
def test_generate_vae_tiling_on_a_model_without_it_exits_2_before_starting(nothing_starts, tmp_path, capsys):
    out = tmp_path / "x.mp4"
    code = cli.main(["generate", "--prompt", "a fox", "--model", "tiny-wan", "--vae-tiling", "--nproc", "2",
                     "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "--vae-tiling: Wan models decode without diffusers' spatial tiles" in err and "Traceback" not in err, err


@pytest.mark.timeout(120)
def test_generate_bad_model_fails_clearly(nothing_starts, tmp_path, capsys):
    code = cli.main(["generate", "--prompt", "a fox", "--model", "/nonexistent/model", "--nproc", "2",
                     "--out", str(tmp_path / "m.mp4")])
    err = capsys.readouterr().err
    assert code == 2 and "'/nonexistent/model' does not exist" in err and "Traceback" not in err


def _summary(stdout: str) -> dict[int, tuple[str, str]]:
    """Summary table rows -> {line: (name, status)}."""
    rows = {}
    for row in stdout.splitlines():
        match = re.match(r"(\d+)\s+(\S+)\s+(ok|skipped|invalid|failed)\b", row)
        if match:
            rows[int(match.group(1))] = (match.group(2), match.group(3))
    return rows


@pytest.mark.timeout(300)
def test_batch_reports_bad_lines_and_resumes(commands, out):
    first = commands.result("batch")
    assert first.returncode == 1, first.stderr[-4000:]
    assert _summary(first.stdout) == {1: ("fox", "ok"), 2: ("-", "invalid"), 3: ("00003", "invalid"),
                                      4: ("00004", "ok")}
    assert "invalid JSON" in first.stdout and "num_frames=40 is not 8k+1" in first.stdout
    out_dir = out / "batch"
    fox, fps = read_mp4(out_dir / "fox.mp4")
    assert fox.shape == (9, 64, 96, 3) and fps == 8  # the line's own keys win over the command's defaults
    whale, fps = read_mp4(out_dir / "00004.mp4")
    assert whale.shape == (17, 64, 96, 3) and fps == 25  # LTXPipeline's frame_rate
    assert sorted(p.name for p in out_dir.iterdir()) == ["00004.mp4", "fox.mp4"]  # no temporary files left
    mtimes = {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()}

    second = commands.result("batch again", COMMANDS["batch"])
    assert second.returncode == 1  # the invalid lines are still invalid
    assert _summary(second.stdout) == {1: ("fox", "skipped"), 2: ("-", "invalid"), 3: ("00003", "invalid"),
                                       4: ("00004", "skipped")}
    assert {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()} == mtimes
    assert "loaded" not in second.stderr, "nothing to do: the model must not be loaded"


def test_batch_failed_job_is_reported_and_the_rest_continue(tmp_path):
    """The leader's batch loop with a job that fails on some rank and an output that cannot be written (in
    process, with a stand-in for the group: no model)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "frames": 9, "height": 32, "width": 32}) + "\n"
                               for p in ("one", "two", "three", "four")))
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    (out_dir / "00003").write_text("a file where line 3's frames folder must go")
    args = cli.build_parser(["batch"]).parse_args(["batch", str(prompts), "--out-dir", str(out_dir),
                                                   "--ext", "frames"])
    info = ModelInfo(path=tmp_path, family="ltx-video", geometry=VideoGeometry(), layers=2,
                     options=model_options("ltx-video", layers=2, stages=1))
    items = batch._plan_batch(args, info, GenerationLimits())
    rng = np.random.default_rng()

    class FakeLeader:
        stops = 0

        def generate(self, request, job_id):
            if request.prompt == "two":
                raise JobFailed("rank 1: RuntimeError: out of memory")
            return Generated(rng.integers(0, 256, size=(request.num_frames, request.height, request.width, 3),
                                          dtype=np.uint8))

        def stop(self):
            self.stops += 1

    leader = FakeLeader()
    assert batch._lead_batch(leader, items, args) == 1
    assert [(i.name, i.status) for i in items] == [("00001", "ok"), ("00002", "failed"), ("00003", "failed"),
                                                   ("00004", "ok")]
    assert "out of memory" in items[1].message and "could not write" in items[2].message
    assert leader.stops == 1
    assert sorted(p.name for p in out_dir.iterdir()) == ["00001", "00003", "00004"]
    assert (out_dir / "00003").is_file()
    assert read_frames_dir(out_dir / "00004")[0].shape == (9, 32, 32, 3)


def test_batch_lines_with_ltx2_options(tmp_path):
    """LTX-2's options in a prompts file: checked against the model's family (and its geometry) line by line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in (
        {"prompt": "rain", "frames": 9, "height": 64, "width": 96, "stg_scale": 1.5, "stg_blocks": [0, 1]},
        {"prompt": "wind", "frames": 9, "height": 32, "width": 96},
        {"prompt": "surf", "frames": 9, "height": 64, "width": 64, "guidance_rescale": 2},
    )) + "\n")
    args = cli.build_parser(["batch"], options=model_options("ltx2", layers=2, stages=1)).parse_args(
        ["batch", str(prompts), "--out-dir", str(tmp_path / "o"), "--audio-guidance", "5"])
    ltx2 = ModelInfo(path=tmp_path, family="ltx2", geometry=VideoGeometry(min_latent_side=2), layers=2,
                     options=model_options("ltx2", layers=2, stages=1))
    items = batch._plan_batch(args, ltx2, GenerationLimits())
    assert [i.status for i in items] == ["todo", "invalid", "invalid"], items
    options = items[0].request.options
    assert options["spatio_temporal_guidance_blocks"] == (0, 1) and options["stg_scale"] == 1.5
    assert options["audio_guidance_scale"] == 5  # the command's default
    assert options["modality_scale"] == 3.0 and options["max_sequence_length"] == 1024  # LTX2Pipeline's defaults
    assert "height=32 is not a multiple of 32 of at least 64" in items[1].message
    assert "guidance_rescale=2 is out of range" in items[2].message
    ltx_video = ModelInfo(path=tmp_path, family="ltx-video", geometry=VideoGeometry(), layers=2,
                     options=model_options("ltx-video", layers=2, stages=1))
    args = cli.build_parser(["batch"]).parse_args(["batch", str(prompts), "--out-dir", str(tmp_path / "o")])
    items = batch._plan_batch(args, ltx_video, GenerationLimits())
    assert [i.status for i in items] == ["invalid", "todo", "invalid"]
    assert "unknown key(s) 'stg_blocks', 'stg_scale': not options of LTX-Video models" in items[0].message
    assert "unknown key(s) 'guidance_rescale'" in items[2].message


def test_strip_nproc():
    assert strip_nproc(["generate", "--nproc", "2", "--out", "x.mp4"]) == ["generate", "--out", "x.mp4"]
    assert strip_nproc(["batch", "p.jsonl", "--nproc=4"]) == ["batch", "p.jsonl"]
    assert strip_nproc(["generate", "--prompt", "a fox"]) == ["generate", "--prompt", "a fox"]


def test_leader_exit_code_goes_to_the_status_file(tmp_path, monkeypatch):
    """A relaunched leader whose group ended in step hands its code to the parent, and exits 0 to torchrun."""
    status = tmp_path / "status"
    monkeypatch.delenv("CP_INFER_LEADER_STATUS", raising=False)
    assert leader_exit_code(1) == 1  # not relaunched: the code itself
    monkeypatch.setenv("CP_INFER_LEADER_STATUS", str(status))
    assert leader_exit_code(0) == 0 and not status.exists()
    assert leader_exit_code(1) == 0 and status.read_text() == "1"


def test_decode_frames_per_rank_option(capsys):
    """``--decode-frames-per-rank`` reaches the runtime config (``auto`` by default, ``all``: one round); bad values
    exit 2 at parsing."""
    from server.cli.common import runtime_config_from_args
    from server.group.runtime import RuntimeConfig

    def parsed(*flags: str):
        args = cli.build_parser().parse_args(["generate", *PROMPT, "--out", "x.mp4", *flags])
        return runtime_config_from_args(args).decode_frames_per_rank

    assert parsed() == RuntimeConfig().decode_frames_per_rank == "auto"
    assert parsed("--decode-frames-per-rank", "3") == 3
    assert parsed("--decode-frames-per-rank", "all") is None
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as exit_info:
            parsed("--decode-frames-per-rank", bad)
        assert exit_info.value.code == 2
        assert "--decode-frames-per-rank" in capsys.readouterr().err
    for bad in (0, "often"):
        with pytest.raises(ValueError, match="expected a whole number >= 1, 'auto' or None"):
            RuntimeConfig(decode_frames_per_rank=bad)

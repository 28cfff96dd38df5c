"""Hub ids (``--model org/name[@revision]``, ``--upsampler``; ``models.common.hub``), all offline: a hub cache laid out
by
the test under a temporary ``HF_HOME`` (``HF_HUB_OFFLINE=1``, as ``tests/conftest.py`` sets it), and a fake hub
endpoint on loopback for the download path (subprocesses with ``HF_ENDPOINT`` pointing at it).

- Which files a repo contributes (``needed_files``), from repo file lists shaped like Lightricks' repos.
- ``org/name`` resolves to its cached snapshot and generates the local folder's frames bit for bit (the same files:
  the same weights, laid out at the same offsets); ``@revision`` (a tag, a commit) picks that commit's weights; a
  local folder of the same spelling wins; a paired ``--upsampler`` repo declares and loads two stages.
- A missing id is one line naming the id and the fix, no traceback: ``generate`` exits 2, ``serve`` answers
  ``503 model_unavailable`` with it.
- Two processes resolving one id at once: one downloads, the other waits on the lock and then resolves from the
  cache; every needed file is downloaded once, and nothing else (root single files, pickle, variants) ever is.
- The hub's answers (no such repo, no such revision, gated, unreachable) are each one line naming the id and fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cp_infer.request import GenerationRequest
from cp_infer.sampler import sample
from models.common.hub import FileSelection, HubRef, hub_cache, needed_files, parse_hub_ref
from models.common.loading import ModelLoadError, resolve_files, resolve_model

from ._hub_fixtures import FakeHub, HubRepo, folder_files, lay_out_snapshot

ROOT = Path(__file__).resolve().parents[2]
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40

# A listing shaped like Lightricks/LTX-Video's: the diffusers folders, the single-file checkpoints at the root, a
# pickle duplicate, a weights variant, media.
LTX_VIDEO_REPO = [
    ".gitattributes", "README.md", "model_index.json", "ltx-video-2b-v0.9.safetensors",
    "ltxv-13b-0.9.7-dev.safetensors", "ltxv-spatial-upscaler-0.9.7.safetensors", "media/example.gif",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json", *(f"text_encoder/model-0000{i}-of-00004.safetensors" for i in range(1, 5)),
    "text_encoder/model.safetensors.index.json", "text_encoder/pytorch_model.bin.index.json",
    "text_encoder/pytorch_model-00001-of-00002.bin", "text_encoder/pytorch_model-00002-of-00002.bin",
    "tokenizer/added_tokens.json", "tokenizer/special_tokens_map.json", "tokenizer/spiece.model",
    "tokenizer/tokenizer_config.json",
    "transformer/config.json", "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
    "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
    "transformer/diffusion_pytorch_model.safetensors.index.json",
    "transformer/diffusion_pytorch_model.fp16.safetensors",
    "transformer/diffusion_pytorch_model.safetensors.index.fp16.json",
    "vae/config.json", "vae/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.bin",
]
LTX_VIDEO_NEEDED = [
    "model_index.json", "scheduler/scheduler_config.json",
    "text_encoder/config.json", *(f"text_encoder/model-0000{i}-of-00004.safetensors" for i in range(1, 5)),
    "text_encoder/model.safetensors.index.json",
    "tokenizer/added_tokens.json", "tokenizer/special_tokens_map.json", "tokenizer/spiece.model",
    "tokenizer/tokenizer_config.json",
    "transformer/config.json", "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
    "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
    "transformer/diffusion_pytorch_model.safetensors.index.json",
    "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
]
# Lightricks/LTX-2's shape: eight components and the latent upsampler, the single files at the root.
LTX2_REPO = [
    "model_index.json", "ltx-2-19b-dev.safetensors", "ltx-2-19b-distilled.safetensors",
    "ltx-2-spatial-upscaler-x2-1.0.safetensors",
    *(f"{c}/config.json" for c in ("transformer", "vae", "audio_vae", "vocoder", "connectors", "latent_upsampler")),
    *(f"{c}/diffusion_pytorch_model.safetensors"
      for c in ("transformer", "vae", "audio_vae", "vocoder", "connectors", "latent_upsampler")),
    "scheduler/scheduler_config.json", "text_encoder/config.json", "text_encoder/generation_config.json",
    "text_encoder/model.safetensors", "tokenizer/tokenizer.json", "tokenizer/tokenizer.model",
    "tokenizer/tokenizer_config.json", "tokenizer/special_tokens_map.json", "tokenizer/chat_template.jinja",
]


def test_needed_files_of_diffusers_repos():
    assert needed_files(LTX_VIDEO_REPO, repo_id="Lightricks/LTX-Video") == LTX_VIDEO_NEEDED
    every = needed_files(LTX2_REPO, repo_id="Lightricks/LTX-2")
    assert every[0] == "model_index.json" and set(every) == {f for f in LTX2_REPO if "/" in f} | {every[0]}
    configs = needed_files(LTX2_REPO, FileSelection(weights=False), repo_id="Lightricks/LTX-2")
    assert configs == [f for f in every if not f.endswith(".safetensors")]
    single = needed_files(LTX2_REPO, FileSelection(skip_weights=frozenset({"transformer", "vae"})),
                          repo_id="Lightricks/LTX-2")
    assert single == [f for f in every if f not in ("transformer/diffusion_pytorch_model.safetensors",
                                                    "vae/diffusion_pytorch_model.safetensors")]
    upsampler = needed_files(LTX2_REPO, FileSelection(only=frozenset({"latent_upsampler"})), repo_id="x/y")
    assert upsampler == ["model_index.json", "latent_upsampler/config.json",
                         "latent_upsampler/diffusion_pytorch_model.safetensors"]
    # A bare model at a repo's root (a latent-upsampler repo): its config and weights.
    bare = ["README.md", ".gitattributes", "config.json", "diffusion_pytorch_model.safetensors",
            "diffusion_pytorch_model.bin"]
    assert needed_files(bare, repo_id="x/up") == ["config.json", "diffusion_pytorch_model.safetensors"]


def test_repos_that_cannot_load_are_refused():
    with pytest.raises(ModelLoadError, match=r"'x/y': text_encoder/ holds its weights only as pickle \(.*bin\).* "
                                             "never loads"):
        needed_files(["model_index.json", "text_encoder/config.json", "text_encoder/pytorch_model.bin"],
                     repo_id="x/y")
    with pytest.raises(ModelLoadError, match=r"transformer/ holds only variant weights"):
        needed_files(["model_index.json", "transformer/config.json",
                      "transformer/diffusion_pytorch_model.fp16.safetensors"], repo_id="x/y")
    with pytest.raises(ModelLoadError, match="'x/y' is not a diffusers-format model .* --model FILE.safetensors "
                                             "--config"):
        needed_files(["README.md", "ltx-2-19b-dev.safetensors"], repo_id="x/y")
    # Configs alone need no weights, pickle or not.
    assert needed_files(["model_index.json", "text_encoder/config.json", "text_encoder/pytorch_model.bin"],
                        FileSelection(weights=False), repo_id="x/y") == ["model_index.json",
                                                                         "text_encoder/config.json"]


def test_parse_hub_ref_and_the_cache_folder(monkeypatch, tmp_path):
    assert parse_hub_ref("Lightricks/LTX-2") == HubRef("Lightricks/LTX-2", "main")
    assert parse_hub_ref("org/name@v1.0") == HubRef("org/name", "v1.0")
    assert parse_hub_ref(f"org/name@{COMMIT_A}") == HubRef("org/name", COMMIT_A)
    for text in ("tiny-ltx2", "/abs/folder", "a/b/c", "org/name@", "./x/y", "org/na me", "org--x/y", "x.safetensors"):
        assert parse_hub_ref(text) is None, text
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache() == tmp_path / "cache"


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty hub cache for this test (``HF_HOME``), offline; returns the cache folder."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    return tmp_path / "hf" / "hub"


@pytest.fixture(scope="module")
def tiny() -> Path:
    return resolve_model("tiny-ltx-video")


def _repo_files(folder: Path) -> dict[str, bytes]:
    """What the hub would hold for a pushed folder: the files a download fetches (no cp-infer marker)."""
    files = folder_files(folder)
    return {rel: files[rel] for rel in needed_files(files, repo_id="org/tiny")}


def _frames(model_spec, seed: int) -> np.ndarray:
    from cp_infer import single_process_state
    from models.registry import open_model

    state = single_process_state()
    model = open_model(model_spec, dtype="fp32", state=state)
    request = GenerationRequest.of(prompt="a paper boat on a puddle", negative_prompt="blurry", num_frames=9,
                                   height=64, width=96, num_inference_steps=2, seed=seed, stages=1)
    return sample(model, request, state=state)


def test_hub_id_generates_as_the_local_folder(hf_home, tiny):
    snapshot = lay_out_snapshot(hf_home, "org/tiny", _repo_files(tiny), commit=COMMIT_A)
    assert resolve_model("org/tiny") == snapshot
    assert resolve_files("org/tiny").upsampler == snapshot / "latent_upsampler"
    seed = int(torch.randint(2**31, ()))
    assert np.array_equal(_frames("org/tiny", seed), _frames(tiny, seed))


def test_revision_picks_its_commit(hf_home, tiny):
    from safetensors.torch import load, save

    from models.ltx_video.loading import load_ltx_video

    files = _repo_files(tiny)
    lay_out_snapshot(hf_home, "org/tiny", files, commit=COMMIT_A)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    changed = {k: v + 0.5 * torch.randn_like(v) for k, v in load(files[weights]).items()}
    lay_out_snapshot(hf_home, "org/tiny", {**files, weights: save(changed)}, commit=COMMIT_B, refs=("v2",))
    for spec, commit in (("org/tiny", COMMIT_A), ("org/tiny@main", COMMIT_A), ("org/tiny@v2", COMMIT_B),
                         (f"org/tiny@{COMMIT_B}", COMMIT_B), (f"org/tiny@{COMMIT_A}", COMMIT_A)):
        assert resolve_model(spec).name == commit, spec
    loaded = load_ltx_video(resolve_model("org/tiny@v2")).transformer.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in changed.items())
    assert not torch.equal(load_ltx_video(resolve_model("org/tiny")).transformer.state_dict()["proj_in.weight"],
                           changed["proj_in.weight"])
    with pytest.raises(ModelLoadError, match=r"'org/tiny@nope' is not a local path, and hub repo 'org/tiny' "
                                             r"\(revision 'nope'\) is not in the hub cache .* HF_HUB_OFFLINE=1"):
        resolve_model("org/tiny@nope")


def test_a_local_folder_wins_over_a_hub_id(hf_home, tiny, tmp_path, monkeypatch):
    lay_out_snapshot(hf_home, "org/tiny", _repo_files(tiny), commit=COMMIT_A)
    local = tmp_path / "work" / "org" / "tiny"
    for rel, data in _repo_files(tiny).items():
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(data)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_model("org/tiny") == local.resolve()


def test_a_paired_upsampler_repo(hf_home, tiny, tmp_path):
    """``--upsampler org/up`` (config.json and weights at the repo's root, as a bare upsampler repo ships) on a folder
    without one: two-stage options declared, the upsampler loaded; one of the other family's latents is refused."""
    from models.registry import describe_model
    from server.cli.command import build_parser
    from server.cli.common import runtime_config_from_args
    from server.group.runtime import start_runtime

    up = {rel.removeprefix("latent_upsampler/"): data for rel, data in folder_files(tiny).items()
          if rel.startswith("latent_upsampler/")}
    snapshot = lay_out_snapshot(hf_home, "org/up", up, commit=COMMIT_A)
    bare = tmp_path / "bare"
    for rel, data in _repo_files(tiny).items():
        if not rel.startswith("latent_upsampler/"):
            (bare / rel).parent.mkdir(parents=True, exist_ok=True)
            (bare / rel).write_bytes(data)
    assert describe_model(bare).options["stages"].default == 1
    info = describe_model(bare, upsampler="org/up")
    assert info.options["stages"].default == 2 and info.options["stages"].hi == 2
    # The flag reaches RuntimeConfig, which every rank builds its runtime from.
    args = build_parser(["generate"]).parse_args(["generate", "--prompt", "x", "--out", "x.mp4", "--model", str(bare),
                                                  "--upsampler", "org/up"])
    config = runtime_config_from_args(args)
    assert (config.model, config.upsampler, config.model_config) == (str(bare), "org/up", None)
    runtime = start_runtime(config)
    try:
        loaded = runtime.model.components.latent_upsampler.state_dict()
        from safetensors.torch import load

        assert all(torch.equal(loaded[k], v) for k, v in load(up["diffusion_pytorch_model.safetensors"]).items())
        assert runtime.model.options["stages"].default == 2
    finally:
        from cp_infer import destroy_parallel

        destroy_parallel(runtime.state)
    assert resolve_files(bare, upsampler="org/up").upsampler == snapshot
    # A model folder as the upsampler source: its latent_upsampler/.
    assert resolve_files(bare, upsampler=str(tiny)).upsampler == tiny / "latent_upsampler"
    with pytest.raises(ModelLoadError, match="--upsampler 'org/up' is a LTXLatentUpsamplerModel, but the model is "
                                             "ltx2"):
        describe_model("tiny-ltx2", upsampler="org/up")


def _cli(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "server.cli", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_missing_id_is_one_line_exit_2_and_a_503_from_serve(tmp_path):
    """Through ``generate`` (exit 2) and ``serve``, which fetches the model before any group forms: the same one line,
    then only its front end, ``503 model_unavailable`` with that line on every path but ``/health``, until stopped."""
    import signal

    import httpx

    from server.cli.launch import free_port

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    port = free_port()
    runs = {"generate": _cli("generate", "--model", "org/missing", "--prompt", "x", "--out",
                             str(tmp_path / "x.mp4"), env=env),
            "serve": _cli("serve", "--model", "org/missing", "--port", str(port), "--data-dir",
                          str(tmp_path / "data"), "--nproc", "2", env=env)}
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert runs["serve"].poll() is None, runs["serve"].communicate()[1]
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    answers = {path: httpx.request(method, url + path, timeout=5, json={"prompt": "x"})
               for method, path in (("POST", "/v1/videos"), ("GET", "/v1/models"), ("GET", "/ready"))}
    runs["serve"].send_signal(signal.SIGTERM)
    for command, proc in runs.items():
        _, err = proc.communicate(timeout=300)
        lines = [line for line in err.splitlines() if line.strip()]
        # serve: uvicorn's shutdown, then the SIGTERM re-raised, as any cp-infer server exits on it
        assert proc.returncode == (2 if command == "generate" else -signal.SIGTERM), (command, err)
        assert len(lines) == 1 and "Traceback" not in err, (command, err)
        assert lines[0].startswith(f"cp-infer {command}: error: 'org/missing' is not a local path, and hub repo "
                                   "'org/missing'"), lines[0]
        assert "HF_HUB_OFFLINE=1" in lines[0] and "HF_HOME" in lines[0], lines[0]
    for path, r in answers.items():
        error = r.json()["error"]
        assert r.status_code == 503 and error["code"] == "model_unavailable", (path, r.text)
        assert lines[0].endswith(error["message"]), (path, error)
    assert answers["/ready"].json()["status"] == "not_ready"
    assert not (tmp_path / "data").exists()  # serve started nothing


# A process resolving hub ids against $HF_ENDPOINT; it prints one JSON line: {spec: path or the error's message}.
_RESOLVE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from models.common.folder_problems import ModelLoadError  # as models.common.hub: no diffusers import
from models.common.hub import fetch, parse_hub_ref
out = {}
for spec in sys.argv[1:]:
    try:
        out[spec] = str(fetch(parse_hub_ref(spec)))
    except ModelLoadError as exc:
        out[spec] = "error: " + str(exc)
print(json.dumps(out), flush=True)
"""


def _resolver(specs: list[str], *, endpoint: str, home: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.Popen([sys.executable, "-u", "-c", _RESOLVE, *specs], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_line(stream, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"never saw {needle!r}; saw {''.join(seen)!r}")


@pytest.fixture(scope="module")
def fake_hub(tiny):
    files = {**_repo_files(tiny), "ltx-video-2b-v0.9.safetensors": b"\0" * 64, "README.md": b"# tiny",
             "transformer/diffusion_pytorch_model.fp16.safetensors": b"\0" * 32,
             "text_encoder/pytorch_model.bin": b"\0" * 32}
    hub = FakeHub({"org/tiny": HubRepo({COMMIT_A: files}, {"main": COMMIT_A}),
                   "org/gated": HubRepo({COMMIT_A: files}, {"main": COMMIT_A}, gated=True)})
    yield hub, files
    hub.close()


def test_two_processes_download_once(fake_hub, tmp_path, tiny):
    """The first holds the lock while its download is held up; the second waits on the lock, then resolves from
    the cache: both get the same snapshot, each needed file was downloaded once, no other file ever."""
    hub, files = fake_hub
    home = tmp_path / "hf"
    hub.hold.clear()
    try:
        first = _resolver(["org/tiny"], endpoint=hub.endpoint, home=home)
        assert hub.first_download.wait(timeout=120), first.stderr.read() if first.poll() is not None else ""
        second = _resolver(["org/tiny"], endpoint=hub.endpoint, home=home)
        _wait_for_line(second.stderr, "waiting for another process to download org/tiny", timeout=120)
    finally:
        hub.hold.set()
    paths = [json.loads(p.communicate(timeout=120)[0])["org/tiny"] for p in (first, second)]
    snapshot = home / "hub" / "models--org--tiny" / "snapshots" / COMMIT_A
    assert paths == [str(snapshot)] * 2
    needed = needed_files(files, repo_id="org/tiny")
    assert dict(hub.downloads) == {("org/tiny", f): 1 for f in needed}
    assert folder_files(snapshot) == {f: files[f] for f in needed}
    assert (home / "hub" / ".locks" / "models--org--tiny" / "cp-infer.lock").is_file()


def test_the_hubs_answers_are_one_line_each(fake_hub, tmp_path, monkeypatch):
    hub, _ = fake_hub
    home = tmp_path / "hf"
    out, err = _resolver(["org/tiny", "org/missing", "org/tiny@nope", "org/gated"], endpoint=hub.endpoint,
                         home=home).communicate(timeout=120)
    got = json.loads(out)
    assert got["org/tiny"].endswith(COMMIT_A)
    assert got["org/missing"] == ("error: 'org/missing' is not a local path, and the Hugging Face Hub has no model "
                                  "repo 'org/missing' (or it is private and HF_TOKEN is unset or cannot read it); "
                                  "check the id, or set HF_TOKEN to a token with access")
    assert got["org/tiny@nope"] == ("error: hub repo 'org/tiny' has no revision 'nope'; name one of its branches, "
                                    "tags or commits (org/tiny@main, org/tiny@<commit>)")
    assert got["org/gated"].startswith("error: hub repo 'org/gated' is gated: accept its conditions at "
                                       "https://huggingface.co/org/gated")
    assert "HF_TOKEN" in got["org/gated"]
    assert all("\n" not in message for message in got.values())
    # The hub unreachable: a cached repo still resolves (with a warning); an uncached one is one line.
    dead = "http://127.0.0.1:9"
    out, err = _resolver(["org/tiny", "org/other"], endpoint=dead, home=home).communicate(timeout=120)
    got = json.loads(out)
    assert got["org/tiny"].endswith(COMMIT_A) and "could not reach the hub for org/tiny" in err
    assert got["org/other"].startswith("error: could not reach the Hugging Face Hub for 'org/other' (")
    assert "is not in the hub cache" in got["org/other"]
    # Offline, from the cache the download left (its tree listing says which files each use needs).
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    snapshot = resolve_model("org/tiny")
    assert snapshot.name == COMMIT_A
    (snapshot / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    assert resolve_files("org/tiny", weights=False).folder == snapshot  # configs alone: still complete
    with pytest.raises(ModelLoadError, match=r"the cached snapshot of hub repo 'org/tiny' in .* is incomplete "
                                             r".*HF_HUB_OFFLINE unset"):
        resolve_model("org/tiny")

"""A request inside the limits it names is accepted: drawn deployment limits (``--max-steps``, ``--max-frames``,
``--max-side``, ``--max-guidance``, ``--max-fps``) and drawn requests naming some of every family's limited options
(within those limits; an option of a step cache that is off at any value), sent through each front end: the HTTP
API (JSON and a form) and the playground (its options route, then what its page sends: the fields that differ from
the defaults it shows), in process over a stub engine; ``generate``'s flags; a ``batch`` prompts file. Every one is
accepted, every value named is the value used, and every default is within the limits (lowered where it was over).

The playground's page script runs in node over a stand-in DOM (``http/playground_body.js``), not in a browser:
``tests/server/http/test_playground.py`` drives the page itself in Chromium.
"""

from __future__ import annotations

import base64
import io
import json
import math
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_infer.options import ModelOptions
from cp_infer.request import GenerationLimits, GenerationRequest, check_request, resolve_request
from cp_infer.shapes import VideoGeometry
from models.registry import ModelInfo, model_options
from models.wan.options import WanLayout, wan_options
from server.http.app import AppConfig, create_app

from .http.test_server_app import StubEngine


def _helios_frames(hi: int) -> list[int]:
    """``HeliosPipeline``'s frame counts within ``hi``: whole chunks of 33 frames (its default 9 latent frames a
    chunk), cut to ``4k + 1``."""
    out, count = [], 1
    while (frames := (count * 33 - 1) // 4 * 4 + 1) <= hi:
        out.append(frames)
        count += 1
    return out


@dataclass(frozen=True)
class Variant:
    name: str
    family: str
    options: ModelOptions
    geometry: VideoGeometry
    upsampler: bool = False
    frames: Callable[[int], list[int]] | None = None
    """The frame counts the model takes within a limit, where they are not every ``t*k + 1``."""

    def frame_counts(self, hi: int) -> list[int]:
        if self.frames is not None:
            return self.frames(hi)
        t = self.geometry.temporal_compression
        return list(range(1, hi + 1, t))


_WAN = VideoGeometry(temporal_compression=4, spatial_compression=8, patch_size=2)
VARIANTS = [
    Variant("ltx-video", "ltx-video", model_options("ltx-video", layers=48), VideoGeometry(), upsampler=True),
    Variant("ltx-video-1-stage", "ltx-video", model_options("ltx-video", layers=48, latent_upsampler=False),
            VideoGeometry()),
    Variant("ltx2", "ltx2", model_options("ltx2", layers=48), VideoGeometry(min_latent_side=2), upsampler=True),
    Variant("ltx2-distilled", "ltx2", model_options("ltx2", layers=48, latent_upsampler=False, distilled=True),
            VideoGeometry(min_latent_side=2)),
    Variant("wan", "wan", wan_options(), _WAN),
    # The embedded tiny Wan's VAE compresses 16x: its sizes step by 32, not the 16 Wan 2.1's options declare.
    Variant("wan-tiny", "wan", wan_options(), VideoGeometry(temporal_compression=4, spatial_compression=16,
                                                              patch_size=2)),
    Variant("wan-a14b", "wan", wan_options(WanLayout(experts=2, boundary_ratio=0.875)), _WAN),
    Variant("wan-ti2v", "wan", wan_options(WanLayout(expand_timesteps=True)),
            VideoGeometry(temporal_compression=4, spatial_compression=16, patch_size=2)),
    Variant("wan-i2v", "wan", wan_options(WanLayout(image=True)), _WAN),
    Variant("helios", "helios", model_options("helios", layers=40), _WAN, frames=_helios_frames),
]
_IDS = [v.name for v in VARIANTS]

_SETTINGS = settings(max_examples=30, derandomize=True, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))
_LIMITED = ("max_steps", "max_frames", "max_side", "max_guidance", "max_fps")
_PAGE_BODY = Path(__file__).resolve().parent / "http" / "playground_body.js"
_SMALL_SIDE, _SHORT = 512, 65
"""Named sizes and frame counts stay under these, so that no drawn request comes near ``--max-tokens``."""


@st.composite
def limits_and_values(draw, variant: Variant) -> tuple[GenerationLimits, dict]:
    """Limits, and the option values a request names: each limited option maybe, within its limit (an option of
    a step cache that is off at any value its declaration takes), in a combination the model takes."""
    shortest = variant.frame_counts(200)[0]  # a limit below every count the model takes refuses every request
    limits = GenerationLimits(max_steps=draw(st.integers(2, 60)), max_frames=draw(st.integers(shortest, 200)),
                              max_side=draw(st.integers(128, 1536)),
                              max_guidance=draw(st.integers(0, 3000)) / 100, max_fps=draw(st.integers(1, 120)))
    options, geometry = variant.options, variant.geometry
    values: dict = {}
    maybe = st.booleans()
    if "stages" in options and draw(maybe):
        values["stages"] = draw(st.sampled_from([1, 2] if variant.upsampler else [1]))
    stages = values.get("stages", options["stages"].default if "stages" in options else 1)
    step, smallest = geometry.spatial_step, geometry.spatial_step * geometry.min_latent_side
    if stages == 2:
        step, smallest = math.lcm(step, 64), 2 * smallest
    for side in ("height", "width"):
        if draw(maybe):
            top = min(limits.max_side, _SMALL_SIDE) // step
            values[side] = step * draw(st.integers(max(1, -(-smallest // step)), top))
    if draw(maybe):
        values["num_frames"] = draw(st.sampled_from(variant.frame_counts(max(min(limits.max_frames, _SHORT),
                                                                             shortest))))
    if draw(maybe):
        values["num_inference_steps"] = draw(st.integers(2, limits.max_steps))
    if draw(maybe):
        values["frame_rate"] = draw(st.integers(1, limits.max_fps))
    for option in options:
        if option.limit == "max_guidance" and draw(maybe):
            values[option.name] = draw(st.integers(0, int(limits.max_guidance * 100))) / 100
    if "cache" in options and draw(maybe):
        values["cache"] = draw(st.sampled_from(["none", "first_block", "taylorseer"]))
        on = values["cache"] == "taylorseer"
        for name in ("cache_interval", "disable_cache_before_step"):
            if draw(maybe):  # off: any value; on: within --max-steps
                values[name] = draw(st.integers(1, limits.max_steps if on else 500))
    return limits, values


def _check_used(variant: Variant, limits: GenerationLimits, values: dict, used: dict) -> None:
    """``used`` (every option's value) keeps what was named and holds every default within the limits, one over
    a limit lowered to the largest value under it that the model takes (frames and sides along their steps)."""
    for name, value in values.items():
        assert used[name] == value, (name, value, used[name])
    for option in variant.options:
        if option.limit is None or option.name in values or used[option.name] is None:
            continue
        hi, value = getattr(limits, option.limit), used[option.name]
        assert value <= hi, (option.name, value, option.limit, hi)
        if value != option.default:  # lowered: to the largest value the model takes under the limit
            step = 0
            if option.name == "num_frames":
                assert option.default > hi and value == variant.frame_counts(int(hi))[-1], (value, hi)
                continue
            if option.name in ("height", "width"):
                step = variant.geometry.spatial_step
                step = math.lcm(step, 64) if used.get("stages") == 2 else step
            largest = value + step > hi if step else value == hi
            assert option.default > hi and largest, (option.name, value, step, option.limit, hi)


def _png_data_url() -> str:
    from PIL import Image

    out = io.BytesIO()
    pixels = np.random.default_rng(5).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def image_url() -> str:
    return _png_data_url()


def _app(tmp_path, variant: Variant):
    engine = StubEngine(tmp_path)
    engine.options, engine.geometry, engine.family = variant.options, variant.geometry, variant.family
    engine.store.max_queue = 1_000_000  # every example queues a job; none runs
    return engine, TestClient(create_app(AppConfig(), engine))


def _job_values(job: dict, options: ModelOptions) -> dict:
    standard = {"frame_rate": "fps"}
    return {o.name: (tuple(v) if isinstance(v := job[standard.get(o.name, o.name)], list) else v) for o in options}


@pytest.mark.parametrize("variant", VARIANTS, ids=_IDS)
def test_http_takes_a_request_inside_the_limits_it_names(tmp_path, variant, image_url):
    engine, client = _app(tmp_path, variant)
    media = {"input_reference": image_url} if variant.options.needs_image else {}

    @_SETTINGS
    @given(drawn=limits_and_values(variant))
    def run(drawn):
        limits, values = drawn
        engine.limits = limits
        r = client.post("/v1/videos", json={"prompt": "after the fuzz", **values, **media})
        assert r.status_code == 200, (limits, values, r.text)
        _check_used(variant, limits, values, _job_values(r.json(), variant.options))
        form = {k: str(v) for k, v in {**values, **media}.items()}
        r = client.post("/v1/videos", data={"prompt": "after the fuzz", **form})
        assert r.status_code == 200, (limits, values, r.text)
        _check_used(variant, limits, values, _job_values(r.json(), variant.options))

    with client:
        run()


def _page_bodies(options_json: dict, cases: list[dict], defaults: list[dict]) -> dict:
    """What the playground's page sends for each case (``tests/server/http/playground_body.js``: its own
    playground.js in node over a stand-in DOM; ``defaults``: ``POST /playground/defaults``'s answer to each case),
    what it shows, and the number fields its browser would refuse to submit."""
    if shutil.which("node") is None:
        pytest.fail("node is needed to run the playground's page script (apt-get install nodejs)")
    page = {"options": options_json, "cases": cases, "defaults": defaults}
    run = subprocess.run(["node", str(_PAGE_BODY)], input=json.dumps(page), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def _field_value(option, text: str):
    """A playground field's text as the value it shows (the page's ``shown``: JSON for lists, ``""`` for unset)."""
    if text == "":
        return None if option.nullable or option.default is None else ""
    if option.kind in (tuple, list):
        value = json.loads(text)
        return tuple(value) if option.kind is tuple else value
    if option.kind is bool:
        return text == "true"
    return option.kind(text)


@pytest.mark.parametrize("variant", VARIANTS, ids=_IDS)
def test_the_playground_form_starts_inside_its_ranges_and_what_it_sends_is_taken(tmp_path, variant, image_url):
    """The page's form, built from ``GET /playground/options`` by playground.js, starts with every number inside its
    min and max (a browser submits nothing else); a user who types the drawn values sends what the page's body()
    makes of them (the fields changed from the defaults shown), and the API takes it."""
    engine, client = _app(tmp_path, variant)
    media = {"input_reference": image_url} if variant.options.needs_image else {}

    @settings(_SETTINGS, max_examples=12)
    @given(drawn=limits_and_values(variant))
    def run(drawn):
        limits, values = drawn
        engine.limits = limits
        cases = [{}, values]
        defaults = [client.post("/playground/defaults", json=case) for case in cases]
        assert all(d.status_code == 200 for d in defaults), (limits, values, [d.text for d in defaults])
        page = _page_bodies(client.get("/playground/options").json(), cases, [d.json() for d in defaults])
        assert not page["out_of_range"], (limits, page["out_of_range"])
        # The page asked for the defaults under what was typed (the answer given was for exactly that).
        if values:
            assert json.loads(json.dumps(values)) == page["asked"][1], (values, page["asked"])
        plain, typed = page["bodies"]
        assert plain == {"prompt": "after the fuzz"}  # nothing changed: nothing but the prompt is sent
        for body, shown in zip((plain, typed), page["shown"], strict=True):
            r = client.post("/v1/videos", json={**body, **media})
            assert r.status_code == 200, (limits, body, r.text)
            # What the page shows in every field is what the job gets, sent or not (a default lowered under
            # stages=2 included).
            job = _job_values(r.json(), variant.options)
            assert {o.name: _field_value(o, shown[o.name]) for o in variant.options} == job, (values, body, shown)
        _check_used(variant, limits, values, job)

    with client:
        run()


@pytest.mark.parametrize("variant", VARIANTS, ids=_IDS)
def test_generate_takes_a_request_inside_the_limits_it_names(tmp_path, variant):
    from server.cli import command as cli
    from server.cli.common import request_from_args

    parser = cli.build_parser(["generate"], options=variant.options)

    @_SETTINGS
    @given(drawn=limits_and_values(variant))
    def run(drawn):
        limits, values = drawn
        flags = [item for name, value in values.items() for item in (variant.options[name].flag, str(value))]
        args = parser.parse_args(["generate", "--prompt", "after the fuzz", "--out", str(tmp_path / "o.mp4"),
                                  *flags])
        # What _cmd_generate's check runs (its limits are the defaults; here the drawn ones).
        request = resolve_request(request_from_args(args, variant.options, prompt=args.prompt, seed=args.seed),
                                  variant.options, limits=limits, geometry=variant.geometry)
        check_request(request, geometry=variant.geometry, limits=limits, options=variant.options,
                      media_pending=variant.options.needs_image)
        _check_used(variant, limits, values, {o: request.option(o) for o in variant.options.names})

    run()


@pytest.mark.parametrize("variant", VARIANTS, ids=_IDS)
def test_batch_takes_a_line_inside_the_limits_it_names(tmp_path, variant):
    from PIL import Image

    from server.cli import batch
    from server.cli import command as cli

    Image.fromarray(np.random.default_rng(6).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(tmp_path / "i.png")
    info = ModelInfo(path=tmp_path, family=variant.family, geometry=variant.geometry, layers=48,
                     options=variant.options)
    prompts = tmp_path / "p.jsonl"
    args = cli.build_parser(["batch"], options=variant.options).parse_args(
        ["batch", str(prompts), "--out-dir", str(tmp_path / "o")])
    media = {"image": "i.png"} if variant.options.needs_image else {}

    @_SETTINGS
    @given(drawn=limits_and_values(variant))
    def run(drawn):
        limits, values = drawn
        prompts.write_text(json.dumps({"prompt": "after the fuzz", **values, **media}) + "\n")
        (item,) = batch._plan_batch(args, info, limits)
        assert item.status == "todo", (limits, values, item.message)
        _check_used(variant, limits, values, {o: item.request.option(o) for o in variant.options.names})

    run()


def test_the_draws_cover_every_family_and_every_limit_an_option_names():
    """Every family the docs show has variants here, and every limit an option of theirs names is one the draws
    vary (a new family or limit is drawn, or this fails)."""
    from server.cli.options_doc import FAMILIES

    assert set(FAMILIES) <= {v.family for v in VARIANTS}
    named = {o.limit for v in VARIANTS for o in v.options if o.limit is not None}
    assert named <= set(_LIMITED) <= {f.name for f in fields(GenerationLimits)}, named


def test_two_stages_under_a_side_limit_too_small_for_them_name_stages():
    """A request that asks for two stages where no size within ``--max-side`` halves to one the model takes is told
    to set ``stages`` (what it gave), not refused for a default size."""
    variant = VARIANTS[2]  # LTX-2: sides of at least 64, so stage 1 needs 128
    with pytest.raises(ValueError, match=r"^stages=2 halves the size.*max_side=100.*use stages=1"):
        variant.options.resolve({"stages": 2}, limits=GenerationLimits(max_side=100), geometry=variant.geometry)
    one = variant.options.resolve({"stages": 1}, limits=GenerationLimits(max_side=100), geometry=variant.geometry)
    assert (one["height"], one["width"]) == (96, 96)


def test_the_issues_preview_server_takes_a_plain_request(tmp_path):
    """``cp-infer serve --max-steps 2`` (in process): the smallest request, and one naming nothing but the prompt,
    are taken; the job reports the defaults it used, lowered to the limits."""
    engine, client = _app(tmp_path, VARIANTS[1])
    engine.limits = GenerationLimits(max_steps=2)
    with client:
        r = client.post("/v1/videos", json={"prompt": "after the fuzz", "num_frames": 9, "width": 64, "height": 64,
                                            "num_inference_steps": 2})
        assert r.status_code == 200, r.text
        job = r.json()
        assert (job["cache"], job["cache_interval"], job["disable_cache_before_step"]) == ("none", 2, 2)
        r = client.post("/v1/videos", json={"prompt": "after the fuzz"})
        assert r.status_code == 200, r.text
        assert r.json()["num_inference_steps"] == 2
        # What the client gives is still the client's: refused, naming it.
        r = client.post("/v1/videos", json={"prompt": "after the fuzz", "num_inference_steps": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "num_inference_steps", r.text
        r = client.post("/v1/videos", json={"prompt": "x", "cache": "taylorseer", "cache_interval": 5})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "cache_interval", r.text
        assert error["message"] == "cache_interval=5 is out of range; use a value in [1, 2]"
        r = client.post("/v1/videos", json={"prompt": "x", "cache_interval": 5})  # the cache is off
        assert r.status_code == 200 and r.json()["cache_interval"] == 5, r.text


def test_seconds_take_the_frame_rate_a_request_gets(tmp_path):
    """``seconds`` counts frames at the frame rate used: with ``--max-fps 10`` the default 25 is lowered to 10, so
    one second is 9 frames, not a refusal of a frame rate the client never gave."""
    engine, client = _app(tmp_path, VARIANTS[1])
    engine.limits = GenerationLimits(max_fps=10)
    with client:
        r = client.post("/v1/videos", json={"prompt": "after the fuzz", "seconds": "1", "size": "64x64",
                                            "num_inference_steps": 2})
        assert r.status_code == 200, r.text
        assert (r.json()["fps"], r.json()["num_frames"]) == (10, 9)
        r = client.post("/v1/videos", json={"prompt": "after the fuzz", "seconds": "1", "fps": 25})
        assert r.status_code == 400 and r.json()["error"]["param"] == "fps", r.text


def test_the_openapi_document_takes_what_the_route_takes_under_low_limits(tmp_path):
    """The document's create body under ``--max-steps 2``: a request naming nothing past the limits validates, a
    value given past one does not; TaylorSeer's options are not capped by the schema (the limit applies only while
    ``cache=taylorseer``, a check across fields that the route's 400 makes and the description states)."""
    from jsonschema import Draft202012Validator

    engine, client = _app(tmp_path, VARIANTS[1])
    engine.limits = GenerationLimits(max_steps=2)
    with client:
        doc = client.get("/openapi.json").json()
        validator = Draft202012Validator({**doc, "$ref": "#/paths/~1v1~1videos/post/requestBody/content/"
                                                         "application~1json/schema"})
        steps = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]["schema"][
            "properties"]["num_inference_steps"]
        assert "default 50, here 2" in steps["description"] and "max_steps is 2 here" in steps["description"]
        for body, valid in (({"prompt": "x"}, True), ({"prompt": "x", "cache_interval": 5}, True),
                            ({"prompt": "x", "cache": "taylorseer"}, True),
                            ({"prompt": "x", "cache": "taylorseer", "cache_interval": 2}, True),
                            ({"prompt": "x", "num_inference_steps": 3}, False)):
            assert (not list(validator.iter_errors(body))) == valid, body
            r = client.post("/v1/videos", json=body)
            assert (r.status_code == 200) == valid, (body, r.text)
        interval = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]["schema"][
            "properties"]["cache_interval"]
        assert "maximum" not in interval and "max_steps is 2 here, checked only while cache is taylorseer" in \
            interval["description"]
        r = client.post("/v1/videos", json={"prompt": "x", "cache": "taylorseer", "cache_interval": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_interval", r.text


@pytest.mark.timeout(600)
def test_a_real_preview_server_makes_a_plain_request(tmp_path, cache_dir):
    """The issue as an operator met it: a 2-rank server with low limits makes ``{"prompt": ...}`` with every
    default lowered to them (9 frames at 64x64, 2 steps), and its job says so."""
    from .conftest import ServerProcess

    server = ServerProcess(tmp_path, cache_dir, extra_args=[
        "--max-steps", "2", "--max-frames", "12", "--max-side", "64", "--max-guidance", "2", "--max-fps", "10",
        "--collective-timeout", "60"])
    try:
        server.wait_ready()
        options = {o["name"]: o for o in server.client.get("/playground/options").json()["options"]}
        assert (options["num_inference_steps"]["default"], options["cache_interval"]["default"]) == (2, 2)
        job = server.submit({"prompt": "after the fuzz", "seed": 3})
        assert (job["num_frames"], job["size"], job["num_inference_steps"], job["guidance_scale"], job["fps"],
                job["cache_interval"], job["disable_cache_before_step"]) == (9, "64x64", 2, 2.0, 10, 2, 2), job
        done = server.wait_job(job["id"], timeout=300)
        assert done["status"] == "completed", (done, server.log_tail())
    finally:
        server.stop()


@pytest.mark.parametrize("family", ["ltx-video", "ltx2"])
def test_each_pass_of_a_two_stage_plan_passes_the_ranks_check_under_low_limits(family):
    """Stage 2 runs its recipe's steps and guidance (LTX-Video 10 steps of which 4 run, LTX-2 3 steps without
    guidance), past ``--max-steps 2`` and ``--max-guidance 0.5``: the ranks check each pass (``cp_infer.sampler``) as
    a planned one, held to the model's ranges, since the request it came from met the limits."""
    if family == "ltx-video":
        from models.ltx_video.stages import two_stage_plan
    else:
        from models.ltx2.stages import two_stage_plan
    variant = next(v for v in VARIANTS if v.family == family and v.upsampler)
    limits = GenerationLimits(max_steps=2, max_guidance=0.5, max_side=256, max_frames=17)
    request = resolve_request(GenerationRequest(prompt="after the fuzz"), variant.options, limits=limits,
                              geometry=variant.geometry)
    check_request(request, geometry=variant.geometry, limits=limits, options=variant.options)
    assert request.options["stages"] == 2 and (request.height, request.width) == (256, 256)
    plan = two_stage_plan(request)
    stage_2 = plan.passes[-1].request
    assert stage_2.num_inference_steps > limits.max_steps or stage_2.guidance_scale > limits.max_guidance
    for pass_ in plan.passes:
        check_request(pass_.request, geometry=variant.geometry, limits=limits, options=variant.options, planned=True)
    with pytest.raises(ValueError, match="out of range"):  # held to the limits, stage 2's recipe would fail
        check_request(stage_2, geometry=variant.geometry, limits=limits, options=variant.options)

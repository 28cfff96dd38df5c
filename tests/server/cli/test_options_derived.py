"""Everything a user sees of a model's options is derived from its one declaration: the OpenAPI document, the CLI's
flags and help, the batch keys and the tables of docs/options.md, with the reference pipelines' defaults. In process
(no worker group)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from models.registry import model_options
from server.cli import command as cli
from server.cli import options_doc
from server.cli.common import option_keys
from server.group.jobs import _request_from_json
from server.http.app import AppConfig, create_app

from ..http.test_server_app import StubEngine

FAMILIES = ("ltx-video", "ltx2", "wan")


@pytest.mark.parametrize("family", FAMILIES)
def test_openapi_create_body_is_the_served_models_options(tmp_path, family):
    engine = StubEngine(tmp_path)
    engine.options = model_options(family, layers=48)
    with TestClient(create_app(AppConfig(), engine)) as client:
        schema = client.get("/openapi.json").json()
    body = schema["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    properties = body["properties"]
    for option in engine.options:
        assert option.name in properties, option.name
        default = list(option.default) if isinstance(option.default, tuple) else option.default
        assert properties[option.name]["x-default"] == default, option.name
        assert option.help in properties[option.name]["description"]
    for field in ("prompt", "seconds", "size", "seed", "input_reference", "conditions"):
        assert field in properties
    other = model_options("ltx2" if family == "ltx-video" else "ltx-video", layers=48)
    assert {o.name for o in other} - {o.name for o in engine.options} - set(properties) == (
        {o.name for o in other} - {o.name for o in engine.options}), "another model's options leaked in"


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_help_lists_the_models_options_with_defaults(family):
    options = model_options(family, layers=48)
    for command in ("generate", "batch"):
        parser = cli.build_parser([command], options)
        sub = parser._subparsers._group_actions[0].choices[command]
        text = " ".join(sub.format_help().split())
        for option in options:
            assert option.flag in text, (command, option.flag)
            shown = ",".join(map(str, option.default)) if isinstance(option.default, tuple) else (
                "unset" if option.default is None else repr(option.default))
            assert f"(default {shown})" in text, (command, option.name, shown)
            for flag in option.flags:
                assert flag in text
    keys = option_keys(options)
    assert keys["frames"] == "num_frames" and keys["fps"] == keys["frame_rate"] == "frame_rate"
    if family == "ltx2":
        assert keys["stg_blocks"] == keys["spatio_temporal_guidance_blocks"] == "spatio_temporal_guidance_blocks"
        assert keys["stg"] == "stg_scale" and keys["audio_guidance"] == "audio_guidance_scale"


def test_the_docs_tables_are_generated_from_the_declarations():
    assert options_doc.DOC.name == "options.md" and options_doc.DOC.parent.name == "docs"
    assert options_doc.main(["--check"]) == 0, "run python -m server.cli.options_doc"
    text = options_doc.DOC.read_text(encoding="utf-8")
    for family in FAMILIES:
        table = options_doc.options_table(model_options(family, layers=48))
        assert table in text, family
        for option in model_options(family, layers=48):
            assert f"| `{option.name}`" in table
    assert "| `spatio_temporal_guidance_blocks`, `stg_blocks` |" in options_doc.options_table(
        model_options("ltx2", layers=48))


def test_a_stale_table_fails_the_check_and_is_rewritten(tmp_path, capsys):
    """A table edited by hand (a default changed, a row dropped) fails ``--check`` without the page being touched;
    a run without ``--check`` writes the declared tables back, and the check then passes."""
    page = tmp_path / "options.md"
    fresh = options_doc.render_tables(options_doc.DOC.read_text(encoding="utf-8"))
    stale = fresh.replace("| `161` |", "| `160` |", 1)
    stale = "\n".join(line for line in stale.split("\n") if not line.startswith("| `stg_scale`"))
    assert stale != fresh
    page.write_text(stale, encoding="utf-8")
    assert options_doc.main(["--check", "--doc", str(page)]) == 1
    assert "stale" in capsys.readouterr().err and page.read_text(encoding="utf-8") == stale
    assert options_doc.main(["--doc", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == fresh
    assert options_doc.main(["--check", "--doc", str(page)]) == 0


def test_a_page_without_the_markers_is_an_error_naming_them(tmp_path, capsys):
    page = tmp_path / "options.md"
    page.write_text("# Options\n\n<!-- options:ltx-video -->\n<!-- /options:ltx-video -->\n", encoding="utf-8")
    assert options_doc.main(["--check", "--doc", str(page)]) == 1
    assert "<!-- options:ltx2 -->" in capsys.readouterr().err


def test_a_stored_request_from_before_declared_options_still_loads():
    """Rows written when the request held every family's options as fields: the set ones become options."""
    old = {"prompt": "surf", "negative_prompt": "", "num_frames": 9, "height": 64, "width": 64,
           "num_inference_steps": 2, "guidance_scale": 3.0, "seed": 7, "fps": 24, "decode_timestep": 0.0,
           "decode_noise_scale": None, "max_sequence_length": None, "audio_guidance_scale": 5.0, "stg_scale": None,
           "stg_blocks": [0, 1], "image": None, "conditions": [], "image_cond_noise_scale": None}
    request = _request_from_json(json.dumps(old))
    assert request.options == {"decode_timestep": 0.0, "audio_guidance_scale": 5.0, "stg_blocks": (0, 1)}
    assert (request.num_frames, request.fps, request.seed) == (9, 24, 7)
    from cp_infer.request import resolve_request

    resolved = resolve_request(request, model_options("ltx2", layers=2))
    assert resolved.options["spatio_temporal_guidance_blocks"] == (0, 1)
    assert resolved.options["audio_guidance_scale"] == 5.0 and resolved.options["stg_scale"] == 1.0


@pytest.mark.parametrize("family", ["ltx-video", "ltx2"])  # the families with two stages
def test_two_stages_without_an_upsampler_is_a_400_over_http(tmp_path, family):
    """A served folder without a latent upsampler: stages=2 is refused at the front end, naming stages and the fix,
    and nothing is queued; stages=1 is accepted."""
    from models.registry import model_options as options_of

    engine = StubEngine(tmp_path)
    engine.options = options_of(family, layers=48, latent_upsampler=False)
    with TestClient(create_app(AppConfig(), engine)) as client:
        body = {"prompt": "a fox", "num_frames": 9, "size": "128x128", "num_inference_steps": 2}
        r = client.post("/v1/videos", json=dict(body, stages=2))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "stages" and "latent upsampler" in error["message"] and "stages=1" in error["message"]
        assert engine.store.counts()["queued"] == 0
        assert client.post("/v1/videos", json=dict(body, stages=1)).status_code == 200

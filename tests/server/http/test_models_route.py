"""``GET /v1/models``: the served model in the OpenAI API's shape, with its family, options and adapters."""

from __future__ import annotations

from fastapi.testclient import TestClient

from server.http.app import AppConfig, create_app

from .test_server_app import StubEngine


def _client(tmp_path, **stub):
    engine = StubEngine(tmp_path)
    for name, value in stub.items():
        setattr(engine, name, value)
    return TestClient(create_app(AppConfig(), engine)), engine


def test_the_list_has_the_served_model_with_its_options(tmp_path):
    client, engine = _client(tmp_path)
    with client:
        body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "tiny-ltx-video" and card["object"] == "model" and card["owned_by"] == "cp-infer"
    assert isinstance(card["created"], int) and card["family"] == "ltx-video" and card["adapters"] == []
    assert list(card["options"]) == list(engine.options.names)
    steps = card["options"]["num_inference_steps"]
    assert steps["x-default"] == engine.options["num_inference_steps"].default and "integer" in steps["type"]


def test_retrieve_by_name_a_hub_id_too_and_404_otherwise(tmp_path):
    adapters = [{"name": "style", "bytes": 1024, "loaded": False}]
    client, _ = _client(tmp_path, served_model="Lightricks/LTX-Video", adapters=lambda: adapters)
    with client:
        card = client.get("/v1/models/Lightricks/LTX-Video")
        missing = client.get("/v1/models/tiny-ltx2")
    assert card.status_code == 200 and card.json()["id"] == "Lightricks/LTX-Video"
    assert card.json()["adapters"] == adapters
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "model_not_found" and "Lightricks/LTX-Video" in error["message"]

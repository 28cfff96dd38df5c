"""``GET /v1/models`` and ``GET /v1/models/{model}``: the OpenAI API's model list, which clients call to discover
what a server serves (vLLM and SGLang answer it too).

Invariants:
- One entry: the served model, under the name clients pass as ``model`` (``Engine.served_model``), in OpenAI's
  shape (``id``, ``object: "model"``, ``created``, ``owned_by``) with this server's additions: its ``family``, the
  request ``options`` it declares (each one's JSON schema, as the OpenAPI document has it) and the ``adapters`` a
  request may name in ``loras``.
- Read from the engine only (no group round trip): the model's configs are known before it is loaded.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel

from server.http.engine import Engine, EngineDep
from server.http.openapi import option_schemas
from server.http.schemas import ApiError, error_responses

__all__ = ["router"]

router = APIRouter(prefix="/v1/models", tags=["models"])

_STARTED = int(time.time())


class ModelCard(BaseModel):
    id: str
    """The name clients pass as ``model``."""
    object: Literal["model"]
    created: int
    """When this server started (Unix seconds)."""
    owned_by: str
    family: str
    """The model family (a name of ``models.families.FAMILIES``)."""
    options: dict[str, dict[str, Any]]
    """Each request option the model declares -> its JSON schema (default, range, help)."""
    adapters: list[dict[str, Any]]
    """The LoRA adapters a request may name in ``loras`` (``name``, ``bytes``, ``loaded``)."""


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def _card(engine: Engine) -> dict[str, Any]:
    return {"id": engine.served_model, "object": "model", "created": _STARTED, "owned_by": "cp-infer",
            "family": engine.family, "options": option_schemas(engine), "adapters": engine.adapters()}


@router.get("", response_model=ModelList)
async def list_models(engine: EngineDep) -> dict[str, Any]:
    """The served model (the OpenAI API's model list)."""
    return {"object": "list", "data": [_card(engine)]}


@router.get("/{model:path}", response_model=ModelCard, responses=error_responses(404))
async def retrieve_model(model: str, engine: EngineDep) -> dict[str, Any]:
    """The served model by its name; any other name is not found."""
    if model != engine.served_model:
        raise ApiError(404, "model_not_found", f"model {model!r} is not served here; this server serves "
                       f"{engine.served_model!r} (GET /v1/models lists it)", "model")
    return _card(engine)

"""The OpenAPI document (``/openapi.json``): FastAPI's, made true to what the server answers, with request bodies
derived from the served model's option declaration, this deployment's limits and (once loaded) its geometry.

Invariants:
- Every status an operation answers is in its ``responses``: the errors each route declares beside itself
  (:func:`server.http.schemas.error_responses`), and 401 and 429 (a tenant's requests a minute) on every operation
  but the public ones when the server asks for a key (``--api-key``, or keys in its job store: the document is made
  again when that changes). 404 is also what another tenant's video is answered. Each error has the
  ``ErrorResponse`` schema. FastAPI's 422 is not there: a request that fails validation is answered 400, as every
  other bad request is.
- A body's schema refuses what the route's own checks refuse field by field: types, ranges, multiples, lengths,
  required fields, unknown fields, and the pairs of fields that exclude each other. What depends on more than the
  body (what a media file holds, the queue, a job's state, frame counts at a frame rate) or on another field's value
  (the limit of an option of a feature, ``Option.when``, applies only while the feature is on) is left to the
  statuses.
  The JSON, urlencoded and multipart bodies are each described as the route parses them.
- Every ``$ref`` resolves inside the document: nested schemas are in ``components/schemas``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from fastapi import FastAPI

from cp_infer.options import Option
from cp_infer.request import LORA_NAME, LORA_SCALE, MAX_LORAS
from server.http.config import AppConfig
from server.http.engine import Engine

__all__ = ["JOB_ID_PATTERN", "install_openapi", "openapi_document"]

JOB_ID_PATTERN = "^video_[0-9a-f]{32}$"
"""The server's job ids (``server.group.jobs.valid_job_id``): any other id is answered 404."""
_DATA_URL = "^data:[^,]*;base64,"
_POSITIVE = r"^(0*[1-9][0-9]*(\.[0-9]*)?|0*\.[0-9]*[1-9][0-9]*)$"
_SIZE = "^[0-9]{1,6}[xX][0-9]{1,6}$"
_FORM_LISTS = {int: "^[0-9]{1,6}(,[0-9]{1,6})*$",
               float: r"^[0-9]{1,6}(\.[0-9]{1,12})?(,[0-9]{1,6}(\.[0-9]{1,12})?)*$"}
"""A list option in a form, written as on the command line: integers (``20,28``) or numbers (``1.0,0.725``)."""
_REF = "#/components/schemas/"
_JSON, _FORM, _MULTIPART = "application/json", "application/x-www-form-urlencoded", "multipart/form-data"
_MAX_CONDITIONS = 16
_EDIT_DROPS = ("stream", "live", "input_reference", "input_reference[image_url]", "conditions")


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` or JSON ``null`` (a field left unset)."""
    if "type" in schema and isinstance(schema["type"], str):
        return {**schema, "type": [schema["type"], "null"]}
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}
    if "anyOf" in schema:
        return {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}
    return {"anyOf": [schema, {"type": "null"}]}


def _set(name: str) -> dict[str, Any]:
    """``name`` given and not null."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


class _Bodies:
    """The request bodies of one served model under one deployment."""

    def __init__(self, engine: Engine):
        self.options, self.limits, self.geometry = engine.options, engine.limits, engine.geometry
        self.served_model = engine.served_model
        try:  # what a request that names no option gets: each default within this deployment's limits
            self.defaults = self.options.resolve({}, limits=self.limits, geometry=self.geometry)
        except ValueError:  # a limit below anything the model takes: the errors name it
            self.defaults = {option.name: option.default for option in self.options}

    # -- the parts ---------------------------------------------------------------------------------------------
    def components(self) -> dict[str, dict[str, Any]]:
        data_url = {"type": "string", "pattern": _DATA_URL}
        frames = self.limits.max_frames
        return {
            "MediaRef": {"type": "object", "title": "MediaRef", "description": "A completed job's video, by id.",
                         "properties": {"id": {"type": "string", "pattern": JOB_ID_PATTERN}},
                         "required": ["id"], "additionalProperties": False},
            "ImageReference": {"type": "object", "title": "ImageReference",
                               "description": "The OpenAI API's reference object: an image as a data URL (this "
                                              "server fetches nothing from the network).",
                               "properties": {"image_url": data_url}, "required": ["image_url"],
                               "additionalProperties": False},
            "ConditionParams": {
                "type": "object", "title": "ConditionParams",
                "description": "One conditioning item: an image or a clip (a data URL or a completed job's video), "
                               "the output frame its first frame applies at (negative counts from the end) and its "
                               "strength (1 keeps it as it is).",
                "properties": {"media": {"anyOf": [data_url, {"$ref": _REF + "MediaRef"}]},
                               "frame_index": {"type": "integer", "minimum": -frames, "maximum": frames - 1,
                                               "default": 0},
                               "strength": {"type": "number", "minimum": 0, "maximum": 1, "default": 1.0}},
                "required": ["media"], "additionalProperties": False},
            "LoraParams": {
                "type": "object", "title": "LoraParams",
                "description": "One adapter to apply: one of the server's adapters by name (GET /v1/models lists "
                               "them) and the scale of its update (1: as trained).",
                "properties": {"name": {"type": "string", "pattern": LORA_NAME.pattern},
                               "scale": {"type": "number", "minimum": LORA_SCALE[0], "maximum": LORA_SCALE[1],
                                         "default": 1.0}},
                "required": ["name"], "additionalProperties": False},
        }

    def _media(self, *, form: bool, files: bool, ref: str, what: str) -> dict[str, Any]:
        if files:
            return {"type": "string", "format": "binary", "description": f"{what}: an uploaded file or a data URL"}
        data_url = {"type": "string", "pattern": _DATA_URL}
        if form:
            return {**data_url, "description": f"{what} as a data URL (upload files with multipart/form-data)"}
        return {"anyOf": [data_url, {"$ref": _REF + ref}], "description": what}

    def prompt(self) -> dict[str, Any]:
        return {"type": "string", "minLength": 1, "maxLength": self.limits.max_prompt_chars, "pattern": r"\S",
                "description": "What the video shows."}

    def _option(self, option: Option, *, form: bool) -> dict[str, Any]:
        # An option of a feature meets its limit only while the feature is on: a check across fields, which the
        # description states and the route's 400 makes (a JSON Schema disjunction here is more than schemathesis's
        # generator takes).
        limits = None if option.when else self.limits
        lo, hi = option.bounds(limits)
        multiple = option.multiple_of
        if option.name in ("height", "width") and self.geometry is not None:
            step = self.geometry.spatial_step
            lo, multiple = max(lo or 0, step * self.geometry.min_latent_side), step
        number: dict[str, Any] = {}
        cast = int if option.kind is int or (option.kind is tuple and option.item is int) else float
        if lo is not None:
            number["minimum"] = cast(lo)
        if hi is not None:
            number["maximum"] = cast(hi)
        if multiple:
            number["multipleOf"] = multiple
        kind = option.kind
        if kind in (int, float):
            schema = {"type": "integer" if kind is int else "number", **number}
        elif kind is str:
            schema = {"type": "string"}
            if option.name == "negative_prompt":
                schema["maxLength"] = self.limits.max_prompt_chars
        elif kind is bool:
            schema = {"type": "boolean"}
        elif form:  # a list, written as on the command line ("20,28") or as JSON
            schema = {"type": "string", "pattern": _FORM_LISTS[option.item]} if kind is tuple else \
                {"type": "string", "contentMediaType": "application/json"}
        else:
            items = {"type": "integer" if option.item is int else "number", **number} if kind is tuple else \
                {"type": "object"}
            schema = {"type": "array", "items": items, "minItems": 1, "maxItems": option.max_items}
        default = list(option.default) if isinstance(option.default, tuple) else option.default
        shown = "unset" if default is None else repr(default)
        effective = self.defaults[option.name]
        if effective != option.default:
            shown += f", here {'unset' if effective is None else repr(effective)}"
        note = option.limit_note(self.limits)
        schema["description"] = (f"{option.help} (default {shown}: the reference pipeline's; "
                                 f"{option.describe(limits)}{'; ' + note if note else ''})")
        schema["x-default"] = default
        return schema if form else _nullable(schema)

    def _fields(self, *, form: bool, files: bool) -> dict[str, dict[str, Any]]:
        """``POST /v1/videos``'s fields: the OpenAI API's, the media, then the model's options and their aliases."""
        maybe = (lambda s: s) if form else _nullable
        props: dict[str, dict[str, Any]] = {
            "prompt": self.prompt(),
            "model": maybe({"enum": [self.served_model], "description": "The served model (or leave it out)."}),
            "seconds": ({"type": "string", "pattern": _POSITIVE} if form else {"anyOf": [
                {"type": "string", "pattern": _POSITIVE}, {"type": "number", "exclusiveMinimum": 0},
                {"type": "null"}]}) | {
                "description": "Duration in seconds (the OpenAI API's \"4\", \"8\", \"12\"; any positive duration "
                               "here): the nearest valid frame count at the frame rate, within max_frames. "
                               "Excludes num_frames."},
            "size": maybe({"type": "string", "pattern": _SIZE, "description": "\"WxH\", e.g. \"384x256\", each side "
                           "as width and height take it. Excludes width and height."}),
            "seed": maybe({"type": "integer", "minimum": 0, "maximum": 2**63 - 1,
                           "description": "Noise seed (unset: a random one, reported in the job)."}),
            "stream": maybe({"type": "boolean", "description": "Respond with the MP4 itself (video/mp4), sent "
                                                               "while it is made (also a query parameter)."}),
            "live": maybe({"type": "boolean", "description": "A live video: made window by window as it is "
                           "directed (POST /v1/videos/{video_id}/directions), its first windows from the prompt; "
                           "its length (seconds or num_frames) whole windows."}),
            "input_reference": self._media(form=form, files=files, ref="ImageReference", what=(
                "The first frame (image-to-video); a video clip conditions from frame 0 on. Excludes conditions")),
        }
        if form:
            props["input_reference[image_url]"] = {"type": "string", "pattern": _DATA_URL,
                                                   "description": "input_reference as {\"image_url\": data URL}"}
        else:
            props["input_reference"] = _nullable(props["input_reference"])
            props["conditions"] = {
                "type": ["array", "null"], "items": {"$ref": _REF + "ConditionParams"}, "maxItems": _MAX_CONDITIONS,
                "description": "Images or clips at frame indices with strengths. Excludes input_reference."}
        loras = (f"LoRA adapters of the server's --lora-dir applied, in order, with their scales (at most {MAX_LORAS}, "
                 "each name once; GET /v1/models lists them).")
        props["loras"] = ({"type": "string", "contentMediaType": "application/json",
                           "description": f"{loras} As the JSON list, or as fields loras[0][name], loras[0][scale]."}
                          if form else {"type": ["array", "null"], "items": {"$ref": _REF + "LoraParams"},
                                        "maxItems": MAX_LORAS, "description": loras})
        for option in self.options:
            props[option.name] = self._option(option, form=form)
            for alias in option.aliases:
                props[alias] = {**props[option.name], "deprecated": True,
                                "description": f"Alias of {option.name} (give one of them)."}
        return props

    def _exclusions(self, props: dict[str, Any], *, form: bool) -> list[dict[str, Any]]:
        pairs = [("seconds", "num_frames"), ("size", "width"), ("size", "height"),
                 ("input_reference", "conditions"), ("input_reference", "input_reference[image_url]")]
        rules = [{"not": {"allOf": [_set(a), _set(b)]}} if not form else {"not": {"required": [a, b]}}
                 for a, b in pairs if a in props and b in props]
        # An option under two names is refused whatever their values.
        rules += [{"not": {"required": [o.name, alias]}} for o in self.options for alias in o.aliases]
        return rules

    def _object(self, props: dict[str, Any], required: list[str], rules: list[dict[str, Any]], *, form: bool,
                patterns: dict[str, Any] | None = None) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "object", "properties": props, "required": required,
                                  "additionalProperties": False}
        if patterns:
            schema["patternProperties"] = patterns
        rules = rules + self._exclusions(props, form=form)
        if rules:
            schema["allOf"] = rules
        return schema

    def _conditions_fields(self, *, files: bool) -> dict[str, Any]:
        """A form's conditions: ``conditions[0][media]`` (``[id]``), ``conditions[0][frame_index]``, ..."""
        frames = self.limits.max_frames
        item = r"^conditions\[(0|[1-9][0-9]?)\]"
        return {
            item + r"\[media\]$": self._media(form=True, files=files, ref="MediaRef", what="A condition's media"),
            item + r"\[media\]\[id\]$": {"type": "string", "pattern": JOB_ID_PATTERN},
            item + r"\[frame_index\]$": {"type": "integer", "minimum": -frames, "maximum": frames - 1},
            item + r"\[strength\]$": {"type": "number", "minimum": 0, "maximum": 1},
        }

    @staticmethod
    def _loras_fields() -> dict[str, Any]:
        """A form's loras as fields: ``loras[0][name]``, ``loras[0][scale]``, ..."""
        item = rf"^loras\[[0-{MAX_LORAS - 1}]\]"
        return {item + r"\[name\]$": {"type": "string", "pattern": LORA_NAME.pattern},
                item + r"\[scale\]$": {"type": "number", "minimum": LORA_SCALE[0], "maximum": LORA_SCALE[1]}}

    # -- the bodies --------------------------------------------------------------------------------------------
    def create(self, *, form: bool = False, files: bool = False) -> dict[str, Any]:
        props = self._fields(form=form, files=files)
        patterns = {**self._conditions_fields(files=files), **self._loras_fields()} if form else None
        return self._object(props, ["prompt"], [], form=form, patterns=patterns)

    def _source(self, *, form: bool, files: bool, strength: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        props = {k: v for k, v in self._fields(form=form, files=files).items() if k not in _EDIT_DROPS}
        props["video"] = self._media(form=form, files=files, ref="MediaRef", what="The video to start from")
        rules: list[dict[str, Any]] = []
        if form:
            props["video[id]"] = {"type": "string", "pattern": JOB_ID_PATTERN,
                                  "description": "video as {\"id\": a completed job's id}"}
            rules.append({"oneOf": [{"required": ["video"]}, {"required": ["video[id]"]}]})
        if strength:
            props["strength"] = {"type": "number", "minimum": 0, "maximum": 1, "default": 0.6,
                                 "description": "How much of the video is kept (1: all of it)."}
        return props, rules

    def edit(self, *, form: bool = False, files: bool = False) -> dict[str, Any]:
        props, rules = self._source(form=form, files=files, strength=True)
        return self._object(props, ["prompt"] + ([] if form else ["video"]), rules, form=form,
                            patterns=self._loras_fields() if form else None)

    def extension(self, *, form: bool = False, files: bool = False) -> dict[str, Any]:
        props, rules = self._source(form=form, files=files, strength=False)
        props["seconds"] = {**props["seconds"], "description": "Seconds added after the video's last frame (the "
                            "nearest multiple of the model's frame step at the frame rate). Excludes num_frames."}
        length = [{"required": ["seconds"]}, {"required": ["num_frames"]}] if form else [_set("seconds"),
                                                                                        _set("num_frames")]
        return self._object(props, ["prompt"] + ([] if form else ["video"]), [*rules, {"anyOf": length}],
                            form=form, patterns=self._loras_fields() if form else None)

    def remix(self, **_: bool) -> dict[str, Any]:
        return {"type": "object", "properties": {"prompt": self.prompt()}, "required": ["prompt"],
                "additionalProperties": False}

    def request_body(self, kind: str, description: str) -> dict[str, Any]:
        build = getattr(self, kind)
        return {"required": True, "description": description, "content": {
            _JSON: {"schema": build()},
            _FORM: {"schema": build(form=True)},
            _MULTIPART: {"schema": build(form=True, files=True)},
        }}


_BODIES = {
    ("/v1/videos", "post"): ("create", "The video to make: JSON, or form fields (multipart: with uploaded files)."),
    ("/v1/videos/edits", "post"): ("edit", "The video to redo and the new prompt; length and size default to the "
                                           "video's."),
    ("/v1/videos/extensions", "post"): ("extension", "The video to extend and for how long."),
    ("/v1/videos/{video_id}/remix", "post"): ("remix", "The new prompt (the rest is the video's)."),
}


def option_schemas(engine: Engine) -> dict[str, dict[str, Any]]:
    """Each option the served model declares -> its JSON schema in a JSON body (the same as the document's), by
    name; ``GET /v1/models`` lists them."""
    bodies = _Bodies(engine)
    return {option.name: bodies._option(option, form=False) for option in engine.options}


def openapi_document(app: FastAPI, engine: Engine, config: AppConfig, *, public: Collection[str]) -> dict[str, Any]:
    """The document of ``app`` serving ``engine`` under ``config``; ``public``: the paths no API key guards."""
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    keyed = config.api_key is not None or engine.store.tenants.any_keys()
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    bodies = _Bodies(engine)
    schemas.update(bodies.components())
    variants = ["video", "thumbnail"] + (["frames"] if engine.keep_frames else [])
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            operation["responses"].pop("422", None)
            if (path, method) in _BODIES:
                kind, description = _BODIES[path, method]
                operation["requestBody"] = bodies.request_body(kind, description)
            for parameter in operation.get("parameters", ()):
                if parameter["in"] == "path" and parameter["name"] == "video_id":
                    parameter["schema"]["pattern"] = JOB_ID_PATTERN
                    parameter["description"] = "A video's id (any other id is not found: 404)"
                elif parameter["in"] == "query" and parameter["name"] == "variant":
                    parameter["schema"]["enum"] = variants
                elif parameter["in"] == "query" and parameter["name"] == "after":
                    parameter["schema"] = {"anyOf": [{"type": "string", "pattern": JOB_ID_PATTERN},
                                                     {"type": "null"}]}
            if keyed and path not in public:
                operation["security"] = [{"bearer": []}]
                operation["responses"]["401"] = {
                    "description": "The API key is missing, wrong or revoked (send Authorization: Bearer <key>)",
                    "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
                    "content": {_JSON: {"schema": {"$ref": _REF + "ErrorResponse"}}}}
                operation["responses"].setdefault("429", {
                    "description": "Over a limit of the key's tenant (the error's param names it: rpm, max_jobs, "
                                   "seconds_per_day) or the queue is full; retry after Retry-After seconds",
                    "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                    "content": {_JSON: {"schema": {"$ref": _REF + "ErrorResponse"}}}})
    if keyed:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def install_openapi(app: FastAPI, engine: Engine, config: AppConfig, *, public: Collection[str]) -> None:
    """Serve :func:`openapi_document` as ``app``'s document, made again once the engine's geometry is known."""
    made: dict[object, dict[str, Any]] = {}

    def openapi() -> dict[str, Any]:
        key = (engine.geometry, config.api_key is not None or engine.store.tenants.any_keys())
        if key not in made:
            made.clear()
            made[key] = openapi_document(app, engine, config, public=public)
        app.openapi_schema = made[key]
        return made[key]

    app.openapi = openapi

"""``cp_infer.options``: a declaration resolves request values (aliases, defaults, types, ranges) and refuses
what it does not declare; ``resolve_request`` / ``check_request`` on top of it. Pure Python: no process group."""

from __future__ import annotations

import re

import numpy as np
import pytest

from cp_infer.options import ModelOptions, Option, UnknownOption
from cp_infer.request import GenerationLimits, GenerationRequest, check_request, resolve_request
from cp_infer.shapes import VideoGeometry
from models.common.standard_options import standard_options


def _declaration(**kw) -> ModelOptions:
    rng = np.random.default_rng()
    steps = int(rng.integers(2, 60))
    return ModelOptions("Fake", (
        *standard_options(height=64, width=96, num_frames=17, frame_rate=30, num_inference_steps=steps,
                          guidance_scale=4.5, size_step="a multiple of 32"),
        Option("blend", float, 0.25, "a weight", lo=0, hi=1),
        Option("tokens", int, 256, "text tokens", lo=128, hi=1024, multiple_of=128),
        Option("blocks", tuple, (3,), "blocks", lo=0, hi=7, aliases=("block_list",)),
        Option("scale", float, None, "unset: the model decides", lo=0, hi=1, nullable=True),
    ), **kw)


def test_resolve_fills_every_default_and_keeps_given_values():
    options = _declaration()
    values = options.resolve({"blend": 0.5, "block_list": [1, 2], "num_frames": None})
    assert values["blend"] == 0.5 and values["blocks"] == (1, 2)  # an alias becomes the declared name
    assert values["num_frames"] == 17 and values["tokens"] == 256 and values["scale"] is None
    assert values["num_inference_steps"] == options["num_inference_steps"].default
    assert set(values) == set(options.names)


@pytest.mark.parametrize("values,words", [
    ({"colour": 1}, "colour is not an option of Fake models"),
    ({"blend": 1.5}, "blend=1.5 is out of range; use a value in [0, 1]"),
    ({"blend": "0.5"}, "blend='0.5' must be a finite number"),
    ({"blend": float("nan")}, "must be a finite number"),
    ({"tokens": 200}, "tokens=200 is not a multiple of 128; try 128"),
    ({"tokens": 2.0}, "tokens=2.0 must be an integer"),
    ({"tokens": True}, "must be an integer"),
    ({"blocks": []}, "must be a non-empty list"),
    ({"blocks": [8]}, "blocks[]=8 is out of range; use a value in [0, 7]"),
    ({"blocks": [1], "block_list": [2]}, "blocks was given twice"),
    ({"num_frames": 5000}, None),  # within the declaration; capped only by a deployment's limits
])
def test_resolve_refuses_bad_values_naming_them(values, words):
    options = _declaration()
    if words is None:
        assert options.resolve(values)["num_frames"] == 5000
        with pytest.raises(ValueError, match=r"num_frames=5000 is out of range; use a value in \[1, 1537\]"):
            options.resolve(values, limits=GenerationLimits())
        return
    with pytest.raises(ValueError) as info:
        options.resolve(values)
    assert words in str(info.value)
    if "not an option" in words:
        assert isinstance(info.value, UnknownOption) and info.value.name == "colour"


def test_a_declaration_must_have_the_standard_options_and_unique_names():
    with pytest.raises(AssertionError, match="standard options"):
        ModelOptions("Bare", (Option("blend", float, 0.0, "x"),))
    with pytest.raises(AssertionError, match="unique"):
        _declaration().__class__("Twice", (*_declaration().options, Option("x", int, 1, "x", aliases=("blend",))))


def test_resolve_request_splits_standard_fields_from_the_models_own_options():
    options = _declaration()
    request = resolve_request(GenerationRequest.of(prompt="a fox", frame_rate=12, blend=0.75, seed=3), options)
    assert (request.num_frames, request.height, request.width, request.fps) == (17, 64, 96, 12)
    assert request.guidance_scale == 4.5 and request.negative_prompt == ""
    assert request.options == {"blend": 0.75, "tokens": 256, "blocks": (3,), "scale": None}
    assert resolve_request(request, options) == request  # idempotent
    check_request(request, geometry=VideoGeometry(), limits=GenerationLimits(), options=options)
    assert request.option("frame_rate") == 12 and request.option("blend") == 0.75
    with pytest.raises(ValueError, match="colour is not an option of Fake models"):
        resolve_request(GenerationRequest.of(prompt="a fox", colour="red"), options)
    with pytest.raises(ValueError, match="num_frames was given twice"):
        resolve_request(GenerationRequest(prompt="a fox", num_frames=9, options={"num_frames": 17}), options)


def test_check_request_refuses_media_for_a_model_that_takes_none():
    options = _declaration(takes_media=False)
    from cp_infer.request import Condition

    image = Condition(np.random.default_rng().integers(0, 256, (1, 8, 8, 3), dtype=np.uint8))
    request = resolve_request(GenerationRequest(prompt="a fox", image=image), options)
    with pytest.raises(ValueError, match=r"image: the loaded model \(Fake\) takes no conditioning media"):
        check_request(request, geometry=VideoGeometry(), limits=GenerationLimits(), options=options)


def test_the_engine_names_no_model_family_and_no_familys_option():
    """``cp_infer/`` knows models only through the interfaces it defines: no family, none of a family's options."""
    from pathlib import Path

    import cp_infer
    from cp_infer.step_cache import CACHE_OPTIONS
    from models.registry import model_options
    from models.wan.options import WanLayout, wan_options

    declared = [*(model_options(family, layers=48) for family in ("ltx-video", "ltx2")),
                wan_options(WanLayout(image=True, experts=2, boundary_ratio=0.9, image_tokens=True))]
    own = {name for options in declared for o in options.extra for name in (o.name, *o.aliases)}
    own -= set(CACHE_OPTIONS)  # the engine's own (cp_infer.step_cache.cache_options), which the models declare
    for path in Path(cp_infer.__file__).parent.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "ltx" not in text.lower(), f"{path.name} names a model family"
        assert not re.search(r"\bwan", text.lower()), f"{path.name} names a model family (Wan)"
        named = sorted(name for name in own if name in text)
        assert not named, f"{path.name} names model options {named}"


def _cached(**kw) -> ModelOptions:
    from cp_infer.step_cache import cache_options

    return ModelOptions("Fake", (*_declaration().options, *cache_options(model="Fake")), **kw)


def test_a_default_over_a_limit_is_lowered_to_what_the_limit_allows():
    """A limit refuses only what is given: each default over one becomes the largest value under it that the model
    takes (frames t*k+1, sides on the geometry's step), and the request then passes every check."""
    options = ModelOptions("Big", (
        *standard_options(height=512, width=704, num_frames=161, frame_rate=25, num_inference_steps=50,
                          guidance_scale=3.0, size_step="a multiple of 32"),))
    limits = GenerationLimits(max_steps=4, max_frames=40, max_side=300, max_guidance=1.5, max_fps=12)
    values = options.resolve({}, limits=limits)
    assert (values["num_inference_steps"], values["num_frames"], values["height"], values["width"],
            values["guidance_scale"], values["frame_rate"]) == (4, 33, 288, 288, 1.5, 12)
    wan_like = VideoGeometry(temporal_compression=4, spatial_compression=8, patch_size=2)
    values = options.resolve({}, limits=limits, geometry=wan_like)  # the model's own steps where it is known
    assert (values["num_frames"], values["height"]) == (37, 288) and isinstance(values["guidance_scale"], float)
    request = resolve_request(GenerationRequest(prompt="a fox"), options, limits=limits, geometry=wan_like)
    assert resolve_request(request, options, limits=limits, geometry=wan_like) == request  # idempotent
    check_request(request, geometry=wan_like, limits=limits, options=options)
    # Given, the same values are the client's: refused, naming them.
    for name, value in (("num_inference_steps", 50), ("frame_rate", 25), ("height", 512)):
        with pytest.raises(ValueError, match=rf"^{name}={value} is out of range"):
            options.resolve({name: value}, limits=limits)
    within = options.resolve({"num_inference_steps": 3, "height": 64}, limits=limits)
    assert within["num_inference_steps"] == 3 and within["height"] == 64


def test_an_option_of_a_feature_that_is_off_is_not_checked_against_the_limits():
    options = _cached()
    limits = GenerationLimits(max_steps=2)
    values = options.resolve({"num_inference_steps": 2}, limits=limits)  # the server: --max-steps 2
    assert values["cache"] == "none" and values["cache_interval"] <= 2 and values["disable_cache_before_step"] <= 2
    off = options.resolve({"cache_interval": 40, "disable_cache_before_step": 9}, limits=limits)
    assert (off["cache_interval"], off["disable_cache_before_step"]) == (40, 9)  # kept as given: the cache is off
    on = options.resolve({"cache": "taylorseer"}, limits=limits)  # on: its defaults lowered to the limit
    assert (on["cache_interval"], on["disable_cache_before_step"], on["num_inference_steps"]) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"^cache_interval=40 is out of range; use a value in \[1, 2\]"):
        options.resolve({"cache": "taylorseer", "cache_interval": 40}, limits=limits)
    with pytest.raises(ValueError, match="cache_interval=0 is out of range"):  # the declaration's own range holds
        options.resolve({"cache_interval": 0}, limits=limits)
    request = resolve_request(GenerationRequest.of(prompt="a fox", cache_interval=40, num_frames=9, height=64,
                                                   width=64), options, limits=limits)
    check_request(request, geometry=VideoGeometry(), limits=limits, options=options)  # the re-check agrees


def test_a_limit_below_every_value_names_the_option_and_the_flag():
    options = _declaration()
    with pytest.raises(ValueError, match=r"^num_inference_steps: this server's max_steps=1 is below every "
                                         r"num_inference_steps .*raise --max-steps"):
        options.resolve({}, limits=GenerationLimits(max_steps=1))
    with pytest.raises(ValueError, match=r"^height: this server's max_side=20 .*raise --max-side"):
        options.resolve({}, limits=GenerationLimits(max_side=20))

"""Wan's declared options are WanPipeline's names and defaults; a folder's layout (one or two experts, image-to-video,
per-token timesteps, CLIP image tokens) decides which it declares and what its requests may carry; what a layout
cannot take is refused with a message naming the fix. No process group."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from diffusers import WanImageToVideoPipeline, WanPipeline

from cp_infer.request import Condition, GenerationLimits, GenerationRequest, check_request, resolve_request
from cp_infer.step_cache import CACHE_OPTIONS
from models.wan.options import WanLayout, wan_options

# Declared options WanPipeline does not take: frame_rate is the output's (Wan is not conditioned on it: the model
# cards export at 16 fps); flow_shift is the scheduler's config (UniPCMultistepScheduler(flow_shift=...)), unset
# meaning the folder's. The windows' options (a video longer than one window, which WanPipeline does not make) are
# LTXI2VLongMultiPromptPipeline's names, as LTX-Video's. The step cache's are diffusers' cache configs' fields.
_NOT_ARGUMENTS = {"frame_rate", "flow_shift", "temporal_tile_size", "temporal_overlap", "prompt_segments",
                  *CACHE_OPTIONS}
# negative_prompt=None: WanPipeline's encode_prompt turns it into "".
_RESOLVED = {"negative_prompt": ""}


@pytest.mark.parametrize("layout,pipeline", [
    (WanLayout(), WanPipeline),
    (WanLayout(experts=2, boundary_ratio=0.875), WanPipeline),
    (WanLayout(image=True, image_tokens=True), WanImageToVideoPipeline),
    (WanLayout(expand_timesteps=True), WanPipeline),
], ids=["t2v", "a14b", "i2v", "ti2v"])
def test_names_and_defaults_are_the_reference_pipelines(layout, pipeline):
    parameters = inspect.signature(pipeline.__call__).parameters
    options = wan_options(layout)
    for option in options:
        if option.name in _NOT_ARGUMENTS:
            continue
        assert option.name in parameters, f"{option.name} is not an argument of {pipeline.__name__}"
        expected = _RESOLVED.get(option.name, parameters[option.name].default)
        assert option.default == expected and (option.default is None) == (expected is None), option.name
    assert ("guidance_scale_2" in options) == (layout.experts == 2)
    assert options["frame_rate"].default == (24 if layout.expand_timesteps else 16)
    assert options.takes_media == (layout.image or layout.expand_timesteps)


def test_layout_from_model_index():
    assert WanLayout.from_index({"_class_name": "WanPipeline", "transformer_2": [None, None]}, {}) == WanLayout()
    a14b = WanLayout.from_index({"_class_name": "WanPipeline", "boundary_ratio": 0.875,
                                 "transformer_2": ["diffusers", "WanTransformer3DModel"]}, {})
    assert a14b == WanLayout(experts=2, boundary_ratio=0.875)
    i2v = WanLayout.from_index({"_class_name": "WanImageToVideoPipeline", "image_encoder": ["transformers", "CLIP"]},
                               {"image_dim": 1280})
    assert i2v == WanLayout(image=True, image_tokens=True) and i2v.takes_image
    ti2v = WanLayout.from_index({"_class_name": "WanPipeline", "expand_timesteps": True}, {"image_dim": None})
    assert ti2v == WanLayout(expand_timesteps=True) and ti2v.takes_image


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from models.wan.default import ensure_default_wan_model, save_wan_model

    root = tmp_path_factory.mktemp("wan_options")
    out = {v: save_wan_model(root / v, variant=v) for v in ("i2v", "a14b", "ti2v")}
    out["t2v"] = ensure_default_wan_model(root / "cache")
    return out


def test_describe_model_reads_the_folders_layout(folders):
    from models.registry import describe_model

    expected = {"t2v": (8, False, False), "i2v": (8, True, False), "a14b": (8, False, True), "ti2v": (16, True, False)}
    for variant, (spatial, media, two) in expected.items():
        info = describe_model(folders[variant])
        assert info.family == "wan" and info.layers == 2 and not info.has_audio
        assert (info.geometry.temporal_compression, info.geometry.spatial_compression) == (4, spatial)
        assert (info.geometry.patch_size, info.geometry.patch_size_t) == (2, 1)
        assert info.options.takes_media == media and ("guidance_scale_2" in info.options) == two, variant


def _check(options, geometry, **values):
    request = resolve_request(GenerationRequest.of(**{"prompt": "a fox", "num_frames": 9, "height": 48, "width": 80,
                                                      **values}), options)
    return check_request(request, geometry=geometry, limits=GenerationLimits(), options=options)


def test_what_a_layout_cannot_take_is_refused_naming_the_fix(folders):
    from models.registry import describe_model

    image = Condition(np.zeros((1, 8, 8, 3), np.uint8) + 100)
    t2v, i2v = describe_model(folders["t2v"]), describe_model(folders["i2v"])
    assert _check(t2v.options, t2v.geometry).tokens == 3 * 3 * 5
    with pytest.raises(ValueError, match="takes no conditioning media"):
        _check(t2v.options, t2v.geometry, image=image)
    with pytest.raises(ValueError, match="not 4k\\+1.*try 9, 13"):
        _check(t2v.options, t2v.geometry, num_frames=10)
    with pytest.raises(ValueError, match="height=40 is not a positive multiple of 16"):
        _check(t2v.options, t2v.geometry, height=40)
    with pytest.raises(ValueError, match="guidance_scale_2 is not an option of Wan"):
        _check(t2v.options, t2v.geometry, guidance_scale_2=2.0)
    with pytest.raises(ValueError, match="cache='teacache' is not a step cache of Wan models"):
        _check(t2v.options, t2v.geometry, cache="teacache")
    with pytest.raises(ValueError, match="exactly 512 text tokens"):
        _check(i2v.options, i2v.geometry, image=image, max_sequence_length=256)


def test_the_adapter_refuses_what_its_pipeline_cannot_run(folders):
    from cp_infer import single_process_state
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    image = Condition(np.zeros((1, 8, 8, 3), np.uint8) + 100)
    i2v = WanModel(load_wan(folders["i2v"]), state=single_process_state())
    request = GenerationRequest.of(prompt="a fox", num_frames=9, height=48, width=80)
    with pytest.raises(ValueError, match="image-to-video.*give the first frame as an image"):
        i2v.plan(resolve_request(request, i2v.options))
    conditioned = GenerationRequest(prompt="a fox", conditions=(Condition(image.frames, 4, 0.5),))
    with pytest.raises(ValueError, match="not conditions at frames"):
        i2v.plan(resolve_request(conditioned, i2v.options))

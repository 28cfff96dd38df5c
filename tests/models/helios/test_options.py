"""Helios's declared options are HeliosPipeline's names and defaults, and a request's frames are the pipeline's
whole chunks. No process group."""

from __future__ import annotations

import inspect

import pytest
from diffusers import HeliosPipeline

from cp_infer.step_cache import CACHE_OPTIONS
from models.helios.options import Chunks, helios_options

# Declared options HeliosPipeline does not take: frame_rate is the output's (Helios is not conditioned on it; the
# pipeline's example exports at 24 fps); prompt_segments is the windows' option (LTXI2VLongMultiPromptPipeline's name),
# its windows the chunks (HeliosPipeline takes one prompt); the step cache's are diffusers' cache configs' fields (the
# transformer's enable_cache, not the pipeline's arguments).
_NOT_ARGUMENTS = {"frame_rate", "prompt_segments", *CACHE_OPTIONS}
_RESOLVED = {
    # negative_prompt=None: HeliosPipeline's encode_prompt turns it into "".
    "negative_prompt": "",
    # num_frames=132 makes 4 chunks of 33 frames, which the pipeline returns cut to 129 (4k+1): a request asks for
    # the frames it gets.
    "num_frames": 129,
    # A list argument: the declaration holds a tuple (immutable requests).
    "history_sizes": (16, 2, 1),
}


def test_names_and_defaults_are_the_reference_pipelines():
    parameters = inspect.signature(HeliosPipeline.__call__).parameters
    for option in helios_options():
        if option.name in _NOT_ARGUMENTS:
            continue
        assert option.name in parameters, f"{option.name} is not an argument of HeliosPipeline"
        expected = _RESOLVED.get(option.name, parameters[option.name].default)
        assert option.default == expected and (option.default is None) == (expected is None), option.name
    assert Chunks.for_frames(parameters["num_frames"].default, 9).video_frames == 129
    assert helios_options()["frame_rate"].default == 24


def test_frames_are_whole_chunks():
    """num_frames must be the frames HeliosPipeline returns for its chunks; another is refused naming the nearest."""
    options = helios_options()
    assert [Chunks(k, 9).video_frames for k in (1, 2, 3, 4, 5)] == [33, 65, 97, 129, 165]
    assert options.resolve({"num_frames": 65})["num_frames"] == 65
    assert options.resolve({"num_frames": 17, "num_latent_frames_per_chunk": 3})["num_frames"] == 17
    with pytest.raises(ValueError, match="num_frames=66.*try 33 or 65"):
        options.resolve({"num_frames": 66})


def test_what_the_pipeline_cannot_run_is_refused_naming_the_fix():
    options = helios_options()
    with pytest.raises(ValueError, match="keep_first_frame=false.*use true"):
        options.resolve({"keep_first_frame": False})
    with pytest.raises(ValueError, match="history_sizes"):
        options.resolve({"history_sizes": [16, 2]})
    with pytest.raises(ValueError, match="height=40 is not a positive multiple of 16"):
        from cp_infer import VideoGeometry

        VideoGeometry(temporal_compression=4, spatial_compression=8, patch_size=2).check_side(40, field="height")


def test_prompt_segments_need_more_than_one_chunk():
    options = helios_options()
    segments = [{"start_window": 0, "text": "a"}, {"start_window": 1, "text": "b"}]
    assert options.resolve({"num_frames": 65, "prompt_segments": segments})["prompt_segments"]
    with pytest.raises(ValueError, match="prompt_segments: the video is one chunk"):
        options.resolve({"num_frames": 33, "prompt_segments": segments})


def test_a_video_to_continue_is_one_whole_chunk_or_more_at_frame_0():
    """Video-to-video takes one clip (conditions[0], the API's input_reference or the CLI's --video) as
    HeliosPipeline's video, at frame 0 with strength 1 and at least a chunk's frames; across chunks too (the windows'
    check lets it through for Helios); anything else is refused naming the field and the fix."""
    import numpy as np

    from cp_infer import VideoGeometry
    from cp_infer.request import Condition, GenerationLimits, GenerationRequest, check_request, resolve_request

    options, limits = helios_options(), GenerationLimits()
    geometry = VideoGeometry(temporal_compression=4, spatial_compression=8, patch_size=2)
    clip = np.random.default_rng(0).integers(0, 256, (17, 24, 40, 3), dtype=np.uint8)

    def check(*conditions, frames=17):
        request = resolve_request(GenerationRequest(prompt="a fox", num_frames=frames, height=32, width=32,
                                                    conditions=conditions,
                                                    options={"num_latent_frames_per_chunk": 3}),
                                  options, limits=limits, geometry=geometry)
        check_request(request, geometry=geometry, limits=limits, options=options)

    check(Condition(clip))  # two chunks made after it
    check(Condition(clip[:9]), frames=9)
    with pytest.raises(ValueError, match=r"conditions\[0\].media has 8 frames.*at least 9"):
        check(Condition(clip[:8]))
    with pytest.raises(ValueError, match=r"conditions\[0\].frame_index=0, strength=0.6.*strength 1"):
        check(Condition(clip, strength=0.6))
    with pytest.raises(ValueError, match="conditions has 2 items"):
        check(Condition(clip[:9]), Condition(clip[:9]))


def test_a_pyramid_folder_has_the_pyramid_pipelines_options():
    """A HeliosPyramidPipeline folder's options are that pipeline's names and defaults (its stages' steps for
    num_inference_steps, which must add up to them); the list has one count per stage of the folder's scheduler."""
    from diffusers import HeliosPyramidPipeline

    from models.helios.options import Pyramid

    options = helios_options(Pyramid(stages=3))
    parameters = inspect.signature(HeliosPyramidPipeline.__call__).parameters
    for name in ("use_zero_init", "zero_steps", "is_amplify_first_chunk"):
        assert options[name].default == parameters[name].default, name
    assert list(options["pyramid_num_inference_steps_list"].default) == \
        parameters["pyramid_num_inference_steps_list"].default
    assert "num_inference_steps" not in parameters and options["num_inference_steps"].default == 30
    assert options.resolve({"num_inference_steps": 6, "pyramid_num_inference_steps_list": [2, 2, 2]})
    with pytest.raises(ValueError, match=r"num_inference_steps=30: a pyramid runs .*\[2, 2, 2\].*give "
                                         r"num_inference_steps=6"):
        options.resolve({"pyramid_num_inference_steps_list": [2, 2, 2]})
    with pytest.raises(ValueError, match="scheduler has 3 stages; give 3 step counts"):
        options.resolve({"num_inference_steps": 20, "pyramid_num_inference_steps_list": [10, 10]})
    with pytest.raises(ValueError, match="height=48: a pyramid of 3 stages .* multiples of 64; try 64"):
        options.resolve({"height": 48})

"""Each model's declared options carry its diffusers reference pipeline's argument names and defaults."""

from __future__ import annotations

import inspect

import pytest
from diffusers import (
    LTX2ConditionPipeline,
    LTX2Pipeline,
    LTXConditionPipeline,
    LTXLatentUpsamplePipeline,
    LTXPipeline,
)
from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig
from diffusers.pipelines.ltx.pipeline_ltx_i2v_long_multi_prompt import LTXI2VLongMultiPromptPipeline

from models.registry import model_options

# Declared option -> where the reference pipeline's default is not a plain argument default, what it is and why.
_RESOLVED = {
    # negative_prompt=None: both pipelines' encode_prompt turn it into "".
    ("ltx-video", "negative_prompt"): "",
    ("ltx2", "negative_prompt"): "",
    # LTX2Pipeline: num_frames=None means 121 for checkpoints without a duration head (LTX-2.0/2.3).
    ("ltx2", "num_frames"): 121,
    # A list argument: the declaration holds a tuple (immutable requests); 28 of a real LTX-2's 48 blocks.
    ("ltx2", "spatio_temporal_guidance_blocks"): (28,),
    # LTXPipeline 128, LTXConditionPipeline 256: unset picks the one of the pipeline the request follows.
    ("ltx-video", "max_sequence_length"): None,
    # 0.0 for the upsampler (LTXLatentUpsamplePipeline), 0.25 across windows (LTXI2VLongMultiPromptPipeline): unset
    # picks the one of the pipeline the request follows.
    ("ltx-video", "adain_factor"): None,
    # LTX-2 has no long-video pipeline: the window options are LTXI2VLongMultiPromptPipeline's, its tile 16 latent
    # frames so that LTX2Pipeline's own 121 frames are one window.
    ("ltx2", "temporal_tile_size"): 128,
}
# Options that LTXPipeline / LTX2Pipeline lack, and the pipeline whose argument they are.
_FROM = {("ltx-video", "image_cond_noise_scale"): LTXConditionPipeline,
         ("ltx-video", "adain_factor"): LTXLatentUpsamplePipeline,
         ("ltx-video", "tone_map_compression_ratio"): LTXLatentUpsamplePipeline,
         **{("ltx-video", name): LTXI2VLongMultiPromptPipeline for name in (
             "temporal_tile_size", "temporal_overlap", "temporal_overlap_cond_strength", "cond_strength",
             "prompt_segments")},
         **{("ltx2", name): LTXI2VLongMultiPromptPipeline for name in (
             "temporal_tile_size", "temporal_overlap", "temporal_overlap_cond_strength", "prompt_segments")}}
# Options of a recipe over several pipelines, an argument of none (stages: models.ltx2.stages,
# models.ltx_video.stages; cache: which of diffusers' cache configs, cp_infer.step_cache).
_RECIPE = {("ltx2", "stages"), ("ltx-video", "stages"), ("ltx2", "cache"), ("ltx-video", "cache")}
# The step cache's settings: fields of diffusers' cache configs (transformer.enable_cache(config)), not pipeline
# arguments; declared option -> (config, field).
_CACHE_FIELDS = {"cache_threshold": (FirstBlockCacheConfig, "threshold"),
                 **{name: (TaylorSeerCacheConfig, name) for name in ("cache_interval", "disable_cache_before_step",
                                                                    "max_order")}}


@pytest.mark.parametrize("family,pipeline", [("ltx-video", LTXPipeline), ("ltx2", LTX2Pipeline)])
def test_names_and_defaults_are_the_reference_pipelines(family, pipeline):
    options = model_options(family, layers=48)
    for option in options:
        if (family, option.name) in _RECIPE:
            continue
        if option.name in _CACHE_FIELDS:
            config, name = _CACHE_FIELDS[option.name]
            assert option.default == getattr(config(), name), (option.name, config.__name__)
            continue
        reference = _FROM.get((family, option.name), pipeline)
        parameters = inspect.signature(reference.__call__).parameters
        assert option.name in parameters, f"{option.name} is not an argument of {reference.__name__}"
        default = parameters[option.name].default
        expected = _RESOLVED.get((family, option.name), default)
        if (family, option.name) == ("ltx-video", "adain_factor"):
            assert {LTXLatentUpsamplePipeline: 0.0, LTXI2VLongMultiPromptPipeline: 0.25} == {
                p: inspect.signature(p.__call__).parameters["adain_factor"].default
                for p in (LTXLatentUpsamplePipeline, LTXI2VLongMultiPromptPipeline)}
        # Equal values (LTX2Pipeline's frame_rate 24.0 is an integer here: it is also the output's frame rate;
        # LTXPipeline's guidance_scale 3 a float), and None only where the pipeline's is None.
        assert option.default == expected and (option.default is None) == (expected is None), (
            option.name, option.default, expected)


@pytest.mark.parametrize("family,base,conditioned", [("ltx-video", LTXPipeline, LTXConditionPipeline),
                                                     ("ltx2", LTX2Pipeline, LTX2ConditionPipeline)])
def test_the_condition_pipelines_take_the_same_names(family, base, conditioned):
    """One declaration covers text-to-video and conditioned requests: every option is an argument of the condition
    pipeline too (with the same default, except the text length LTXConditionPipeline raises to 256)."""
    parameters = inspect.signature(conditioned.__call__).parameters
    for option in model_options(family, layers=48):
        assert option.name in parameters or (family, option.name) in {*_RECIPE, *_FROM} \
            or option.name in _CACHE_FIELDS, (conditioned.__name__, option.name)


def test_small_ltx2_models_perturb_their_last_block():
    assert model_options("ltx2", layers=2)["spatio_temporal_guidance_blocks"].default == (1,)
    assert model_options("ltx2", layers=2)["spatio_temporal_guidance_blocks"].hi == 1


@pytest.mark.parametrize("family", ["ltx-video", "ltx2"])
def test_a_cache_the_model_cannot_honour_is_refused_naming_cache(family):
    from cp_infer.step_cache import cache_options

    options = model_options(family, layers=48)
    assert options.resolve({})["cache"] == "none"
    assert options.resolve({"cache": "first_block", "cache_threshold": 0.1})["cache_threshold"] == 0.1
    with pytest.raises(ValueError, match="cache='teacache' is not a step cache of"):
        options.resolve({"cache": "teacache"})
    (only_fbc, *_) = cache_options(model="X", kinds=("none", "first_block"))
    with pytest.raises(ValueError, match="cache='taylorseer' is not a step cache of X models; use one of none, "
                                         "first_block"):
        only_fbc.check("taylorseer")

"""LTX-2's schedules: the ``sigmas`` option (LTX2Pipeline's own argument) and a distilled folder's defaults (its
fixed 8-step schedule, every guidance off), each at 1 rank bit-identical to LTX2Pipeline called as diffusers'
examples call it for that recipe; the refusals of a bad schedule on every front end.

Tolerances as ``test_ltx2_parallel``: frames bit-identical, the waveform equal to float rounding (1e-6).
"""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from cp_infer.request import GenerationRequest, resolve_request
from cp_infer.sampler import SampleControl, sample
from models.ltx2.options import DISTILLED_SIGMAS, GUIDANCE_OFF


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The embedded tiny LTX-2 and a copy of it named as a distilled repository is."""
    from models.ltx2.default import ensure_default_ltx2_model

    dev = ensure_default_ltx2_model()
    distilled = tmp_path_factory.mktemp("hub") / "LTX-2.3-Distilled-Diffusers"
    shutil.copytree(dev, distilled)
    return {"dev": str(dev), "distilled": str(distilled)}


def test_the_schedule_is_diffusers_own():
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

    assert list(DISTILLED_SIGMAS) == DISTILLED_SIGMA_VALUES


def test_a_distilled_folder_is_told_by_its_name_or_its_repository(tmp_path):
    from models.common.loading import is_distilled

    assert is_distilled(tmp_path / "LTX-2.3-Distilled-Diffusers")
    assert is_distilled(tmp_path / "hub" / "models--OzzyGT--LTX-2.3-Distilled" / "snapshots" / "0123abc")
    assert not is_distilled(tmp_path / "hub" / "models--Lightricks--LTX-2" / "snapshots" / "0123abc")
    assert not is_distilled(tmp_path / "tiny-ltx2")


def test_a_distilled_folder_declares_its_recipe_as_defaults(folders):
    from models.registry import describe_model

    dev, distilled = (describe_model(folders[k]).options for k in ("dev", "distilled"))
    assert dev["sigmas"].default is None and dev["num_inference_steps"].default == 30
    assert distilled["sigmas"].default == DISTILLED_SIGMAS
    assert distilled["num_inference_steps"].default == 8 and distilled["guidance_scale"].default == 1.0
    for name, value in GUIDANCE_OFF.items():
        assert distilled[name].default == value, name
    # Everything else is the dev folder's.
    same = set(dev.names) - {"sigmas", "num_inference_steps", "guidance_scale", *GUIDANCE_OFF}
    assert all(dev[n].default == distilled[n].default for n in same)


def _run(folder, request):
    from cp_infer import single_process_state
    from models.ltx2.adapter import LTX2Model
    from models.ltx2.loading import load_ltx2

    model = LTX2Model(load_ltx2(folder), state=single_process_state())
    model.decode_frames_per_rank = None
    request = resolve_request(request, model.options)
    audio = {}
    frames = sample(model, request, state=single_process_state(),
                    control=SampleControl(on_audio=lambda w, sr: audio.update(waveform=w)))
    return request, frames, audio["waveform"]


def _reference(folder, request, **kwargs):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(prompt=request.prompt, num_frames=request.num_frames, height=request.height, width=request.width,
               frame_rate=request.fps, max_sequence_length=request.options["max_sequence_length"],
               spatio_temporal_guidance_blocks=list(request.options["spatio_temporal_guidance_blocks"]),
               generator=torch.Generator("cpu").manual_seed(request.seed), output_type="np", **kwargs)
    return (np.clip(ref.frames[0], 0, 1) * 255).round().astype(np.uint8), ref.audio[0].float().numpy()


def _assert_equal(ours, ref, seed):
    (_, frames, waveform), (ref_frames, ref_audio) = ours, ref
    assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
    np.testing.assert_array_equal(frames, ref_frames, err_msg=f"seed={seed}")
    np.testing.assert_allclose(waveform[:, :ref_audio.shape[1]], ref_audio, rtol=0, atol=1e-6)


SHAPE = dict(num_frames=9, height=64, width=96, fps=24, max_sequence_length=128)


def test_a_distilled_folder_runs_its_schedule_without_guidance_as_ltx2_pipeline(folders):
    seed = random.randrange(2**31)
    ours = _run(folders["distilled"], GenerationRequest.of(prompt="a drummer on a rainy street", seed=seed, **SHAPE))
    request = ours[0]
    assert request.num_inference_steps == 8 and request.options["sigmas"] == DISTILLED_SIGMAS
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

    ref = _reference(folders["distilled"], request, num_inference_steps=8, sigmas=DISTILLED_SIGMA_VALUES,
                     guidance_scale=1.0, **GUIDANCE_OFF)
    _assert_equal(ours, ref, seed)


def test_custom_sigmas_on_a_dev_folder_equal_ltx2_pipeline_given_them(folders):
    seed = random.randrange(2**31)
    sigmas = (1.0, 0.8, 0.45)
    ours = _run(folders["dev"], GenerationRequest.of(prompt="a drummer on a rainy street", seed=seed, sigmas=sigmas,
                                                     num_inference_steps=3, guidance_scale=3.0, **SHAPE))
    request = ours[0]
    ref = _reference(folders["dev"], request, num_inference_steps=3, sigmas=list(sigmas), guidance_scale=3.0,
                     stg_scale=request.options["stg_scale"], modality_scale=request.options["modality_scale"],
                     guidance_rescale=request.options["guidance_rescale"],
                     audio_guidance_scale=request.options["audio_guidance_scale"],
                     audio_stg_scale=request.options["audio_stg_scale"],
                     audio_modality_scale=request.options["audio_modality_scale"],
                     audio_guidance_rescale=request.options["audio_guidance_rescale"])
    _assert_equal(ours, ref, seed)


@pytest.mark.parametrize("values, says", [
    (dict(sigmas=[1.0, 0.5], num_inference_steps=3), "sigmas has 2 values and num_inference_steps=3"),
    (dict(sigmas=[1.0, 0.5, 0.7]), "must fall strictly"),
    (dict(sigmas=[1.0, 0.5, 0.0]), "must stay above 0"),
    (dict(sigmas=[1.5, 0.5, 0.2]), "out of range"),
    (dict(sigmas="1.0,0.5,0.2"), "must be a non-empty list of at most"),
])
def test_a_bad_schedule_is_refused_naming_sigmas(values, says):
    from models.registry import model_options

    options = model_options("ltx2", layers=2, stages=1)
    values = {"num_inference_steps": 3, **values}
    with pytest.raises(ValueError, match="sigmas") as error:
        options.resolve(values)
    assert says in str(error.value)


def test_a_distilled_schedule_is_the_default_at_its_own_step_count_only(folders):
    """The fixed schedule is not the client's: at other steps (given, or a deployment's --max-steps below 8) the
    default is unset (LTX2Pipeline's schedule for that many), never a refusal; sigmas given must still fit."""
    from cp_infer.request import GenerationLimits
    from models.ltx2.options import DISTILLED_SIGMAS
    from models.registry import describe_model

    options = describe_model(folders["distilled"]).options
    assert options.resolve({})["sigmas"] == DISTILLED_SIGMAS
    assert options.resolve({"num_inference_steps": 4})["sigmas"] is None
    preview = options.resolve({}, limits=GenerationLimits(max_steps=4))
    assert preview["num_inference_steps"] == 4 and preview["sigmas"] is None
    with pytest.raises(ValueError, match="give num_inference_steps=8, or 4 sigmas"):
        options.resolve({"num_inference_steps": 4, "sigmas": list(DISTILLED_SIGMAS)})
    assert options.resolve({"num_inference_steps": 4, "sigmas": [1.0, 0.9, 0.7, 0.4]})["sigmas"] == (1.0, 0.9, 0.7, 0.4)


def test_sigmas_from_the_command_line_and_a_form(tmp_path):
    from cp_infer.request import GenerationLimits
    from models.registry import model_options
    from server.cli import command as cli
    from server.http.schemas import params_from_form

    options = model_options("ltx2", layers=2, stages=1)
    args = cli.build_parser(["generate"], options=options).parse_args(
        ["generate", "--prompt", "x", "--out", str(tmp_path / "o.mp4"), "--sigmas", "1.0,0.725,0.4", "--steps", "3"])
    assert args.sigmas == (1.0, 0.725, 0.4)
    params = params_from_form({"prompt": "x", "sigmas": "1.0,0.725,0.4"}, options=options,
                              limits=GenerationLimits(), geometry=None)
    assert params.sigmas == [1.0, 0.725, 0.4]

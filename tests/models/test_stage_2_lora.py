"""The dev two-stage recipe's stage-2 adapter (``--stage-2-lora``, Lightricks' distilled LoRA): stage 2 applies the
operator's adapter after a request's own, stage 1 the request's alone. At 1 rank bit-identical to diffusers' recipe
written with its pipelines (LTX2Pipeline at half size with ``load_lora_weights`` + ``set_adapters`` of the request's
adapter; LTX2LatentUpsamplePipeline; the stage-2 adapter loaded and both set for LTX2Pipeline given the upsampled
latents, the stage-2 sigmas); the refusals of the front end."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from cp_infer.request import GenerationRequest, LoraWeight
from cp_infer.sampler import SampleControl, sample

from ..harness import one_thread
from ..lora_adapters import LTX2_A, LTX2_B, LTX2_CONNECTORS, make_adapter
from ..server.cli.commands import Commands, cli_env
from .ltx2.test_parallel import GUIDANCE

REQUEST = dict(prompt="a drummer plays on a rainy street", negative_prompt="silence, blurry", num_inference_steps=2,
               fps=24, max_sequence_length=128, spatio_temporal_guidance_blocks=(0,), stages=2, num_frames=9,
               height=128, width=320, **GUIDANCE)
OWN, STAGE_2 = LoraWeight("style", 0.7), LoraWeight("distilled", 0.9)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from models.ltx2.default import ensure_default_ltx2_model
    from models.ltx2.loading import load_ltx2

    folder = str(ensure_default_ltx2_model())
    adapters = tmp_path_factory.mktemp("adapters")
    c = load_ltx2(folder)
    make_adapter(c, adapters / "style.safetensors", seed=5, targets=LTX2_A, connectors=LTX2_CONNECTORS)
    make_adapter(c, adapters / "distilled.safetensors", seed=6, targets=LTX2_B)
    return folder, str(adapters)


def _ours(folder, adapters, seed):
    from cp_infer import single_process_state
    from models.registry import open_model

    state = single_process_state()
    model = open_model(folder, dtype="fp32", state=state, lora_dir=adapters, stage_2_loras=(STAGE_2,))
    model.decode_frames_per_rank = None
    active = []
    control = SampleControl(on_step=lambda i, n, s: active.append(model.loras.active))
    frames = sample(model, GenerationRequest.of(**REQUEST, seed=seed, loras=[OWN]), state=state, control=control)
    return frames, active


def _reference(folder, adapters, seed):
    from diffusers import LTX2LatentUpsamplePipeline, LTX2Pipeline
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES

    from models.ltx2.loading import load_ltx2
    from models.ltx2.stages import REFINE_SETTINGS, refine_scheduler

    c = load_ltx2(folder)
    parts = dict(scheduler=c.scheduler, vae=c.vae, audio_vae=c.audio_vae, text_encoder=c.text_encoder,
                 tokenizer=c.tokenizer, connectors=c.connectors, transformer=c.transformer, vocoder=c.vocoder)
    r = GenerationRequest.of(**REQUEST, seed=seed)
    common = dict(prompt=r.prompt, negative_prompt=r.negative_prompt, num_frames=r.num_frames, frame_rate=r.fps,
                  return_dict=False, generator=torch.Generator("cpu").manual_seed(seed), max_sequence_length=128)
    stage1 = LTX2Pipeline(**parts)
    stage1.set_progress_bar_config(disable=True)
    stage1.load_lora_weights(adapters, weight_name="style.safetensors", adapter_name="style")
    stage1.set_adapters(["style"], [OWN.scale])
    video, audio = stage1(height=r.height // 2, width=r.width // 2, num_inference_steps=r.num_inference_steps,
                          output_type="latent", spatio_temporal_guidance_blocks=[0], **GUIDANCE, **common)
    upsample = LTX2LatentUpsamplePipeline(vae=c.vae, latent_upsampler=c.latent_upsampler)
    upsample.set_progress_bar_config(disable=True)
    video = upsample(latents=video, output_type="latent", return_dict=False)[0]
    stage2 = LTX2Pipeline(**{**parts, "scheduler": refine_scheduler(c.scheduler)})
    stage2.set_progress_bar_config(disable=True)
    stage2.load_lora_weights(adapters, weight_name="distilled.safetensors", adapter_name="distilled")
    stage2.set_adapters(["style", "distilled"], [OWN.scale, STAGE_2.scale])
    frames, _ = stage2(latents=video, audio_latents=audio, height=r.height, width=r.width,
                       num_inference_steps=len(STAGE_2_DISTILLED_SIGMA_VALUES), sigmas=STAGE_2_DISTILLED_SIGMA_VALUES,
                       noise_scale=STAGE_2_DISTILLED_SIGMA_VALUES[0], guidance_scale=1.0, output_type="np",
                       **REFINE_SETTINGS, **common)
    return (np.clip(frames[0], 0, 1) * 255).round().astype(np.uint8)


def test_stage_2_adds_the_operators_adapter_as_diffusers_recipe_does(setup):
    seed = random.randrange(2**31)
    frames, active = one_thread(_ours, *setup, seed)
    # Stage 1's two steps with the request's adapter, stage 2's three with both.
    assert active == [(OWN,)] * 2 + [(OWN, STAGE_2)] * 3
    ref = one_thread(_reference, *setup, seed)
    assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
    np.testing.assert_array_equal(frames, ref, err_msg=f"seed={seed}")


def test_pass_loras_and_the_cap():
    from models.common.lora import check_stage_2, pass_loras

    a, b = LoraWeight("a", 0.5), LoraWeight("distilled", 0.2)
    assert pass_loras((a, b), (STAGE_2,), kind="denoise") == (a, b)
    assert pass_loras((a, b), (STAGE_2,), kind="refine") == (a, STAGE_2)  # the stage-2 scale wins
    assert pass_loras((a,), (STAGE_2,), kind="refine_window") == (a, STAGE_2)
    four = tuple(LoraWeight(n) for n in "wxyz")
    check_stage_2(four, (STAGE_2,), stages=1)
    with pytest.raises(ValueError, match="with stages=2 name at most 3"):
        check_stage_2(four, (STAGE_2,), stages=2)


def test_an_unknown_stage_2_adapter_is_refused_before_anything_starts(setup, tmp_path):
    folder, adapters = setup
    base = ["generate", "--model", "tiny-ltx2", "--prompt", "x", "--out", str(tmp_path / "o.mp4")]
    # Side by side: both spend their time importing.
    with Commands({"unknown": [*base, "--lora-dir", adapters, "--stage-2-lora", "nope:0.8"],
                   "no folder": [*base, "--stage-2-lora", "distilled"]},
                  env=cli_env(os.environ["CP_INFER_CACHE"]), cwd=tmp_path, timeout=300) as commands:
        run = commands.result("unknown")
        assert run.returncode == 2, run.stderr
        assert "--stage-2-lora" in run.stderr and "nope" in run.stderr and "Traceback" not in run.stderr
        run = commands.result("no folder")
        assert run.returncode == 2 and "--lora-dir" in run.stderr, run.stderr

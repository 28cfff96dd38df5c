"""Device placement without a GPU: every family's per-step path run with the model and its device on ``meta``.

A tensor made on the CPU that meets one on the model's device fails there as it fails on CUDA ("Tensor on device cpu
is not on the expected device meta"), so this finds, without a GPU, what would crash on one: the passes are run as
the sampler runs them (``cp_infer.sampler._run_pass``: prepare, the shard moved to the device, the transformer passes,
the scheduler step, the padding, the step cache's bookkeeping) for every mode the CUDA path serves: plain, image,
conditions, two stages, step caches, long videos (a first window, and a window after a restored checkpoint: the
second window conditioned on the video made before it), Wan's image-to-video, TI2V, two experts and their windows,
LTX-2's soundtrack in all of them.

A meta tensor has no values, so the few places that read one on the host are stubbed, each that value alone (the
device is never stubbed): the step index a scheduler finds by searching its schedule for the first timestep
(``index_for_timestep``, once per pass), the step cache's decision metric (``cp_infer.step_cache._metric``: skip and
compute both taken), transformers' choice to skip a text encoder's attention mask (``_ignore_*_mask_sdpa``), and
the ancestral scheduler's ``sigma_next.item()`` inside its step. The end of a window (``finish_pass``: the window's
latents folded into the video made so far, on the CPU, for the checkpoint) and the decode read values too: a later
window starts from a checkpoint of random latents restored as a resumed job restores one, on the CPU as it is there.

Tiny configs (the embedded models' components in memory), one rank, few steps. Every case passes when it runs to the
end; a CPU tensor anywhere on the way raises.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cp_infer import single_process_state
from cp_infer.request import Condition, GenerationLimits, GenerationRequest, resolve_request
from cp_infer.sampler import SampleControl, _CacheTotals, _run_pass

STATE = single_process_state("meta")
LIMITS = GenerationLimits()
DECISIONS = [0]
"""First-Block Cache decisions taken (the stubbed metric's calls)."""


@pytest.fixture(scope="module", autouse=True)
def _host_values():
    """The values read on the host, stubbed (see the module docstring)."""
    import transformers.masking_utils
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXEulerAncestralRFScheduler, UniPCMultistepScheduler

    import cp_infer.sampler
    import cp_infer.step_cache

    metrics = [None, 0.0, 1.0]  # compute (no metric), reuse, compute

    def metric(sums: torch.Tensor) -> float | None:
        assert sums.device.type == "meta", sums.device
        DECISIONS[0] += 1
        return metrics[DECISIONS[0] % len(metrics)]

    ancestral_step = LTXEulerAncestralRFScheduler.step

    def step(self, *args, **kwargs):  # its ``sigma_next.abs().item() < 1e-8``: not the last step
        item = torch.Tensor.item
        torch.Tensor.item = lambda t: 1.0 if t.device.type == "meta" else item(t)
        try:
            return ancestral_step(self, *args, **kwargs)
        finally:
            torch.Tensor.item = item

    with pytest.MonkeyPatch.context() as mp:
        # A failure in prepare raises where it happens (the sampler turns it into the group's agreed JobFailed).
        mp.setattr(cp_infer.sampler, "_run_hook", lambda hook: (cp_infer.sampler.StepStatus(hook() or 0), ""))
        for cls in (FlowMatchEulerDiscreteScheduler, LTXEulerAncestralRFScheduler, UniPCMultistepScheduler):
            mp.setattr(cls, "index_for_timestep", lambda self, timestep, schedule_timesteps=None: 0)
        mp.setattr(LTXEulerAncestralRFScheduler, "step", step)
        mp.setattr(cp_infer.step_cache, "_metric", metric)
        for name in ("_ignore_bidirectional_mask_sdpa", "_ignore_causal_mask_sdpa"):
            mp.setattr(transformers.masking_utils, name, lambda *args, **kwargs: False)
        yield


def _on_meta(parts: dict) -> dict:
    """The components with every module moved to ``meta`` (weights without values)."""
    for part in parts.values():
        if isinstance(part, torch.nn.Module):
            part.to("meta")
    return parts


def _run(model, request: GenerationRequest, *, start: int = 0, previous_state=None, passes: int = 2) -> None:
    """Up to ``passes`` passes of ``request``'s plan from ``start`` as the sampler runs them, each prepared from the
    one before; a window pass ends it (its fold into the video reads its latents on the host). A First-Block Cache
    request decides at least once."""
    request = resolve_request(request, model.options, limits=LIMITS)
    decisions = DECISIONS[0]
    plan = model.plan(request)
    previous = None
    for pass_ in plan.passes[start:start + passes]:
        full, prepared = _run_pass(model, pass_, previous, previous_state, done=0, total=plan.steps, limits=LIMITS,
                                   control=SampleControl(), state=STATE, cached=_CacheTotals())
        assert all(x.device.type == "meta" for x in full.values()), {k: x.device for k, x in full.items()}
        if pass_.window is not None:
            break
        previous, previous_state = full, prepared.state
    assert request.options.get("cache") != "first_block" or DECISIONS[0] > decisions, "no step cache decision"


def _image(rng: np.random.Generator, frames: int = 1) -> Condition:
    return Condition(rng.integers(0, 256, (frames, 40, 60, 3), dtype=np.uint8))


def _random(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# LTX-Video


@pytest.fixture(scope="module")
def ltx_video():
    from models.ltx_video.adapter import LTXVideoModel
    from models.ltx_video.default import build_default_components, build_latent_upsampler
    from models.ltx_video.loading import LTXVideoComponents

    parts = _on_meta(dict(build_default_components(), latent_upsampler=build_latent_upsampler()))
    components = LTXVideoComponents(**parts, path=None, dtype=torch.float32, device=STATE.device)
    return LTXVideoModel(components, state=STATE)


@pytest.fixture(scope="module")
def ltx_video_ancestral():
    """With LTXEulerAncestralRFScheduler, which draws noise at every step (its own modules: a model parallelises
    the modules it is given)."""
    from diffusers import LTXEulerAncestralRFScheduler

    from models.ltx_video.adapter import LTXVideoModel
    from models.ltx_video.default import build_default_components
    from models.ltx_video.loading import LTXVideoComponents

    parts = _on_meta(dict(build_default_components(), scheduler=LTXEulerAncestralRFScheduler()))
    return LTXVideoModel(LTXVideoComponents(**parts, path=None, dtype=torch.float32, device=STATE.device),
                         state=STATE)


LTX_BASE = dict(prompt="a red fox | it jumps", negative_prompt="blurry", height=64, width=128, num_inference_steps=4,
                fps=24, guidance_scale=3.0, seed=3)
LTX_WINDOWS = dict(temporal_tile_size=40, temporal_overlap=24)
"""57 frames: 8 latent frames in windows (0, 5), (2, 7), (4, 8) of LTX_BASE's 2 x 4 tokens a frame."""


@pytest.mark.parametrize("mode", ["text", "first_block", "taylorseer", "image", "conditions", "two_stages"])
def test_ltx_video_pass(ltx_video, mode):
    rng = np.random.default_rng(0)
    options = dict(stages=2 if mode == "two_stages" else 1)
    extra = {}
    if mode in ("first_block", "taylorseer"):
        options.update(cache=mode, disable_cache_before_step=1, cache_interval=2)
    if mode == "image":
        extra["image"] = _image(rng)
    if mode in ("conditions", "two_stages"):
        # re-noised at every step (image_cond_noise_scale), a clip after frame 0 as extra tokens
        extra["conditions"] = (Condition(_image(rng).frames), Condition(_image(rng, 9).frames, 8, 0.8))
        options["image_cond_noise_scale"] = 0.15
    _run(ltx_video, GenerationRequest(**LTX_BASE, num_frames=17, options=options, **extra))


@pytest.mark.parametrize("mode", ["first", "later", "later_image", "ancestral_first", "ancestral_later",
                                  "stage_2", "first_block"])
def test_ltx_video_windows(ltx_video, ltx_video_ancestral, mode):
    from models.common.windows import windows_of
    from models.ltx_video.windows import restore_state

    rng = np.random.default_rng(1)
    model = ltx_video_ancestral if mode.startswith("ancestral") else ltx_video
    options = dict(LTX_WINDOWS, stages=2 if mode == "stage_2" else 1)
    if mode == "first_block":
        options.update(cache="first_block")
    image = _image(rng) if mode == "later_image" else None
    request = resolve_request(GenerationRequest(**LTX_BASE, num_frames=57, image=image, options=options),
                              model.options, limits=LIMITS)
    if mode in ("first", "ancestral_first", "first_block"):
        _run(model, request)
        return
    windows, c = windows_of(request), model.transformer.config.in_channels
    h, w = request.height // 32, request.width // 32
    arrays = {"latents": _random(rng, 1, c, windows.made(0), h, w), "first": _random(rng, 1, c, windows.made(0), h, w),
              "window": np.array(0), "stage": np.array(2 if mode == "stage_2" else 0)}
    if mode == "stage_2":
        arrays["upsampled"] = _random(rng, 1, c, windows.latent_frames, h, w)
    restored, _ = restore_state(request, arrays)
    _run(model, request, start=1 + (len(windows) if mode == "stage_2" else 0), previous_state=restored)


# LTX-2


@pytest.fixture(scope="module")
def ltx2():
    from models.ltx2.adapter import LTX2Model
    from models.ltx2.default import build_ltx2_components, build_ltx2_latent_upsampler
    from models.ltx2.loading import LTX2Components

    parts = _on_meta(dict(build_ltx2_components(), latent_upsampler=build_ltx2_latent_upsampler()))
    components = LTX2Components(**parts, path=None, dtype=torch.float32, device=STATE.device)
    return LTX2Model(components, state=STATE)


LTX2_BASE = dict(prompt="waves on a beach | a storm comes", negative_prompt="silence", height=64, width=128,
                 num_inference_steps=3, fps=24, seed=5)
LTX2_GUIDANCE = dict(guidance_scale=3.0, audio_guidance_scale=5.0, stg_scale=1.0, audio_stg_scale=0.5,
                     modality_scale=2.0, audio_modality_scale=1.5, guidance_rescale=0.7, audio_guidance_rescale=0.5,
                     spatio_temporal_guidance_blocks=(0,))
LTX2_WINDOWS = dict(temporal_tile_size=48, temporal_overlap=24)


@pytest.mark.parametrize("mode", ["text", "first_block", "taylorseer", "image", "conditions", "two_stages",
                                  "two_stages_image", "two_stages_conditions"])
def test_ltx2_pass(ltx2, mode):
    rng = np.random.default_rng(2)
    values = dict(LTX2_BASE, **LTX2_GUIDANCE, num_frames=17, stages=2 if mode.startswith("two_stages") else 1)
    if mode.startswith("two_stages"):
        values["height"] = 128  # stage 1 at half the size
    if mode in ("first_block", "taylorseer"):
        values.update(cache=mode, disable_cache_before_step=1, cache_interval=2)
    if mode.endswith("image"):
        values["image"] = _image(rng)
    if mode.endswith("conditions"):
        values["conditions"] = (Condition(_image(rng).frames), Condition(_image(rng, 9).frames, 8, 0.8))
    _run(ltx2, GenerationRequest.of(**values))


@pytest.mark.parametrize("mode", ["first", "later", "stage_2"])
def test_ltx2_windows(ltx2, mode):
    from models.common.windows import windows_of
    from models.ltx2.windows import restore_state

    rng = np.random.default_rng(3)
    request = resolve_request(GenerationRequest.of(**LTX2_BASE, **LTX2_GUIDANCE, **LTX2_WINDOWS, num_frames=97,
                                                   stages=2 if mode == "stage_2" else 1),
                              ltx2.options, limits=LIMITS)
    if mode == "first":
        _run(ltx2, request)
        return
    windows, c = windows_of(request), ltx2.transformer.config.in_channels
    h, w = request.height // 32, request.width // 32
    audio = ltx2.pipe.audio_vae.config.latent_channels * ltx2.pipe.audio_vae.config.mel_bins // 4
    made = ltx2.audio_latent_frames(dataclasses.replace(request, num_frames=(windows.made(0) - 1) * 8 + 1))
    arrays = {"video": _random(rng, 1, c, windows.made(0), h, w), "audio": _random(rng, 1, made, audio),
              "window": np.array(0), "stage": np.array(2 if mode == "stage_2" else 0)}
    if mode == "stage_2":
        total = ltx2.audio_latent_frames(request)
        arrays.update(base_video=_random(rng, 1, c, windows.latent_frames, h, w),
                      base_audio=_random(rng, 1, total, audio))
    restored, _ = restore_state(request, arrays)
    _run(ltx2, request, start=1 + (len(windows) if mode == "stage_2" else 0), previous_state=restored)


# Wan


def _wan(variant: str):
    from diffusers import WanImageToVideoPipeline

    from models.wan.adapter import WanModel
    from models.wan.default import build_wan_pipeline
    from models.wan.loading import WanComponents
    from models.wan.options import WanLayout

    pipe = build_wan_pipeline(variant)
    parts = _on_meta(dict(pipe.components))
    config = pipe.config
    layout = WanLayout(image=isinstance(pipe, WanImageToVideoPipeline),
                       experts=2 if parts.get("transformer_2") is not None else 1,
                       boundary_ratio=config.get("boundary_ratio"),
                       expand_timesteps=bool(config.get("expand_timesteps", False)),
                       image_tokens=parts.get("image_encoder") is not None)
    names = {f.name for f in dataclasses.fields(WanComponents)}
    components = WanComponents(**{k: v for k, v in parts.items() if k in names}, path=None, dtype=torch.float32,
                               device=STATE.device, layout=layout)
    return WanModel(components, state=STATE)


WAN_BASE = dict(prompt="a red fox runs | it jumps", negative_prompt="blurry", num_inference_steps=3, seed=7,
                guidance_scale=4.0, height=16, width=80)
WAN_WINDOWS = dict(temporal_tile_size=17, temporal_overlap=8)


@pytest.mark.parametrize("variant", ["t2v", "a14b", "ti2v", "ti2v_image", "i2v", "a14b-i2v"])
@pytest.mark.parametrize("windows", [False, True], ids=["one_pass", "windows"])
def test_wan(variant, windows):
    rng = np.random.default_rng(4)
    model = _wan(variant.removesuffix("_image"))
    image = _image(rng) if variant in ("ti2v_image", "i2v", "a14b-i2v") else None
    options = dict(guidance_scale_2=2.5) if variant.startswith("a14b") else {}
    width = 64 if variant.startswith("ti2v") else WAN_BASE["width"]
    base = dict(WAN_BASE, width=width, height=32 if variant.startswith("ti2v") else WAN_BASE["height"])
    if not windows:
        _run(model, GenerationRequest(**base, num_frames=9, image=image, options=options))
        return
    chained = model.layout.image
    options.update(dict(temporal_tile_size=17) if chained else WAN_WINDOWS)
    request = resolve_request(GenerationRequest(**base, num_frames=29, image=image, options=options), model.options,
                              limits=LIMITS)
    _run(model, request)  # the first window
    from models.wan.options import wan_windows_of
    from models.wan.windows import restore_state

    ws = wan_windows_of(request)
    grid = model.geometry.latent_shape(request.num_frames, request.height, request.width)
    c = model.components.vae.config.z_dim
    arrays = {"latents": _random(rng, 1, c, ws.made(0), grid.height * model.patch[1], grid.width * model.patch[2]),
              "window": np.array(0)}
    if chained:
        arrays["last_frame"] = rng.integers(0, 256, (request.height, request.width, 3), dtype=np.uint8)
    restored, _ = restore_state(request, arrays, chained_windows=chained)
    _run(model, request, start=1, previous_state=restored)


def test_meta_catches_a_cpu_tensor():
    """The premise: on ``meta`` a CPU tensor meeting a device tensor fails as on CUDA (a 0-d CPU scalar does not, there
    as on CUDA)."""
    on_device = torch.randn(3, device="meta")
    with pytest.raises(RuntimeError, match="expected device meta"):
        torch.where(on_device > 0, on_device, torch.randn(3))
    assert (on_device * torch.tensor(2.0)).device.type == "meta"

"""The other Wan layouts on the engine, each at 1 rank bit-identical to its diffusers reference pipeline and at 2
ranks equal to 1 rank:

- Wan 2.1 I2V (``WanImageToVideoPipeline``: CLIP image tokens in every cross-attention, the 36-channel input of
  latents, mask and image latents), an image of another size than the video;
- Wan 2.2 A14B text-to-video (``WanPipeline`` with ``transformer_2`` and ``boundary_ratio`` 0.875: the first of 3
  steps on the high-noise expert, the others on the low-noise one with ``guidance_scale_2``), and A14B
  image-to-video (``WanImageToVideoPipeline``, 36 channels, no image encoder, boundary 0.9);
- Wan 2.2 TI2V-5B (``expand_timesteps``: a timestep per token, sharded like the tokens; the 48-channel VAE with 2x2
  pixel patches): text-to-video through ``WanPipeline``, image-to-video through ``WanImageToVideoPipeline`` on the
  same folder (the image's first latent frame kept, its tokens at timestep 0).

Every video is 3 x 3 x 5 = 45 tokens (TI2V at twice the size: its VAE compresses 16x), which 2 ranks do not divide;
nor do they the 5 heads. Tolerances as in tests/models/wan/test_wan.py (frames within 1 level, mean 0.01;
latents 1e-4).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from cp_infer.request import Condition, GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...harness import one_thread
from ...worker_groups import SharedGroup

VARIANTS = ("i2v", "a14b", "a14b-i2v", "ti2v")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    from models.wan.default import save_wan_model

    root = tmp_path_factory.mktemp("wan_variants")
    return {v: str(save_wan_model(root / v, variant=v)) for v in VARIANTS}


def _image(seed: int) -> np.ndarray:
    """A colour gradient with noise, uint8 [1, H, W, 3] at another size and aspect than the videos."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:40, 0:70]
    pixels = np.stack([(x * 3) % 256, (y * 5) % 256, ((x + y) * 2) % 256], axis=-1) + rng.integers(-30, 30, (40, 70, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)[None]


def _requests(variant: str, seed: int) -> list[GenerationRequest]:
    base = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", num_inference_steps=3,
                guidance_scale=4.0)
    image = Condition(_image(seed))
    if variant == "i2v":
        return [GenerationRequest(**base, num_frames=9, height=48, width=80, seed=seed, image=image)]
    if variant == "a14b":
        return [GenerationRequest(**base, num_frames=9, height=48, width=80, seed=seed,
                                  options={"guidance_scale_2": 2.5})]
    if variant == "a14b-i2v":
        return [GenerationRequest(**base, num_frames=9, height=48, width=80, seed=seed, image=image)]
    return [GenerationRequest(**base, num_frames=9, height=96, width=160, seed=seed),
            GenerationRequest(**base, num_frames=9, height=96, width=160, seed=seed + 1, image=image)]


def _sample_all(state, folders: dict[str, str], seed: int):
    """``{variant: [(frames, latents), ...]}``."""
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    out = {}
    for variant, folder in folders.items():
        model = WanModel(load_wan(folder), state=state)
        model.decode_frames_per_rank = 1
        out[variant] = []
        for request in _requests(variant, seed):
            latents = {}
            frames = sample(model, request, state=state, control=SampleControl(on_latents=latents.update))
            out[variant].append((frames, latents["latents"] if latents else None))
    return out


def _reference(folder: str, r: GenerationRequest, output_type: str) -> np.ndarray:
    from diffusers import WanImageToVideoPipeline, WanPipeline

    from models.wan.loading import load_wan

    c = load_wan(folder)
    parts = dict(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, scheduler=c.scheduler,
                 transformer=c.transformer, transformer_2=c.transformer_2, boundary_ratio=c.layout.boundary_ratio,
                 expand_timesteps=c.layout.expand_timesteps)
    call = dict(prompt=r.prompt, negative_prompt=r.negative_prompt, num_frames=r.num_frames, height=r.height,
                width=r.width, num_inference_steps=r.num_inference_steps, guidance_scale=r.guidance_scale,
                generator=torch.Generator("cpu").manual_seed(r.seed), output_type=output_type)
    if "guidance_scale_2" in r.options:
        call["guidance_scale_2"] = r.options["guidance_scale_2"]
    if r.image is None:
        pipe = WanPipeline(**parts)
    else:
        pipe = WanImageToVideoPipeline(**parts, image_encoder=c.image_encoder, image_processor=c.image_processor)
        call["image"] = Image.fromarray(r.image.frames[0])
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**call).frames
    if output_type == "latent":
        return out.float().numpy()
    return (np.clip(out[0], 0, 1) * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def one_rank(folders):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(_sample_all, single_process_state(), folders, seed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_rank_equals_the_reference_pipeline(folders, one_rank, variant):
    seed, ours = one_rank
    for r, (frames, latents) in zip(_requests(variant, seed), ours[variant], strict=True):
        assert frames.shape == (r.num_frames, r.height, r.width, 3)
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        # The reference on one thread too, as ours: the thread count alone changes how a matmul's sum is split.
        reference = one_thread(_reference, folders[variant], r, "latent")
        np.testing.assert_array_equal(latents, reference, err_msg=f"seed={seed}")
        np.testing.assert_array_equal(frames, one_thread(_reference, folders[variant], r, "np"), err_msg=f"seed={seed}")


def test_the_low_noise_expert_and_its_guidance_are_used(folders, one_rank):
    """The A14B video differs from WanPipeline's on the high-noise expert alone, and from its own request without
    ``guidance_scale_2`` (the low-noise steps then keep ``guidance_scale``): both experts and ``guidance_scale_2``
    reach the video, so the parity above proves the switch."""
    from dataclasses import replace

    from diffusers import WanPipeline

    from models.wan.loading import load_wan

    seed, ours = one_rank
    (request,) = _requests("a14b", seed)
    frames = ours["a14b"][0][0].astype(np.int16)
    unset = one_thread(_reference, folders["a14b"], replace(request, options={}), "np")
    c = load_wan(folders["a14b"])
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, scheduler=c.scheduler,
                       transformer=c.transformer)
    pipe.set_progress_bar_config(disable=True)
    one_expert = pipe(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
                      height=request.height, width=request.width, num_inference_steps=3, guidance_scale=4.0,
                      generator=torch.Generator("cpu").manual_seed(seed), output_type="np").frames[0]
    one_expert = (np.clip(one_expert, 0, 1) * 255).round().astype(np.int16)
    for other in (unset, one_expert):
        assert np.abs(frames - other.astype(np.int16)).mean() > 0.5


def test_two_ranks_equal_one_rank(folders, one_rank):
    seed, expected = one_rank
    group = SharedGroup(2)
    results = group.run(_sample_all, folders, seed, timeout=600)
    assert all(frames is None for rank in results[1:] for runs in rank.values() for frames, _ in runs)
    for variant in VARIANTS:
        for (exp, exp_latents), (got, got_latents) in zip(expected[variant], results[0][variant], strict=True):
            diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
            assert diff.max() <= 1 and diff.mean() < 0.01, f"{variant} seed={seed}: max {diff.max()} mean {diff.mean()}"
            torch.testing.assert_close(torch.from_numpy(got_latents), torch.from_numpy(exp_latents), rtol=0,
                                       atol=1e-4, msg=lambda m, variant=variant: f"{variant} seed={seed}: {m}")


def test_image_and_text_keys_are_projected_once_per_request(folders):
    """Wan 2.1 I2V: each block's text and image keys (and the image embedder) are computed once per pass of a
    request, not at every step, although the forward joins image and text tokens anew at every step."""
    from cp_infer import single_process_state
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    model = WanModel(load_wan(folders["i2v"]), state=single_process_state())
    calls = dict.fromkeys(("to_k", "add_k_proj", "image_embedder"), 0)

    def count(name):
        return lambda *_: calls.__setitem__(name, calls[name] + 1)

    attn = model.transformer.blocks[1].attn2
    attn.to_k.register_forward_hook(count("to_k"))
    attn.add_k_proj.register_forward_hook(count("add_k_proj"))
    model.transformer.condition_embedder.image_embedder.norm1.register_forward_hook(count("image_embedder"))
    request = GenerationRequest(prompt="a fox", num_frames=5, height=32, width=48, num_inference_steps=4,
                                guidance_scale=3.0, seed=1, image=Condition(_image(1)))
    sample(model, request, state=single_process_state())
    # CFG's two passes share the image tokens but not the text, so each pass's joined context is its own.
    assert calls == {"to_k": 2, "add_k_proj": 2, "image_embedder": 1}

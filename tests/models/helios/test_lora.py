"""Per-request LoRA adapters on tiny-helios (``HeliosLoraLoaderMixin``'s diffusers format): at 1 rank each request of
an interleaved sequence (a, none, a+b, a) on one loaded model is bit-identical to ``HeliosPipeline`` given the same
adapters (``load_lora_weights`` + ``set_adapters``, or ``disable_lora``), and the base weights are unchanged after.

The adapters are random (``tests.lora_adapters``: B is not zero), a in the self-attention (whose processor is the
engine's at N ranks), b in the cross-attention, the feed-forward and the history's patch embedding. At 2 ranks the
request with both adapters equals 1 rank's within 1e-4 on the latents and 1 uint8 level on the frames (the
tolerances of tests/models/helios/test_helios.py; one request, to keep the test short).
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

from cp_infer.request import GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...harness import one_thread
from ...lora_adapters import make_adapter
from ...worker_groups import groups_by_layout
from .._parity import assert_ranks_close

groups = groups_by_layout()

A = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0")
B = ("attn2.to_v", "ffn.net.2", "patch_short")
SEQUENCE = ((("a", 0.8),), (), (("a", 0.8), ("b", -1.5)), (("a", 0.8),))
_SHAPE = dict(num_frames=17, height=32, width=32, num_inference_steps=2, guidance_scale=4.0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from models.helios.default import ensure_default_helios_model
    from models.helios.loading import load_helios

    folder = ensure_default_helios_model(tmp_path_factory.mktemp("helios"))
    adapters = tmp_path_factory.mktemp("adapters")
    components = load_helios(folder)
    make_adapter(components, adapters / "a.safetensors", seed=1, targets=A)
    make_adapter(components, adapters / "b.safetensors", seed=2, targets=B)
    return str(folder), str(adapters)


def _request(seed: int, loras) -> GenerationRequest:
    return GenerationRequest.of(prompt="a drummer plays in the snow", negative_prompt="blurry", seed=seed,
                                loras=[{"name": n, "scale": s} for n, s in loras],
                                num_latent_frames_per_chunk=3, **_SHAPE)


def _weights_hash(model) -> str:
    digest = hashlib.sha256()
    for part in model.lora_parts().values():
        for name, p in sorted(part.named_parameters()):
            if "lora_" not in name:
                digest.update(name.replace(".base_layer", "").encode())
                digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def _run(state, folder: str, adapters: str, seed: int, sequence=SEQUENCE):
    """``[(frames, latents), ...]`` of ``sequence``'s requests, and the base weights' hash before and after."""
    from models.registry import open_model

    model = open_model(folder, dtype="fp32", state=state, lora_dir=adapters)
    before = _weights_hash(model)
    out = []
    for loras in sequence:
        latents = {}
        frames = sample(model, _request(seed, loras), state=state, control=SampleControl(on_latents=latents.update))
        out.append((frames, latents.get("latents")))
    return out, (before, _weights_hash(model))


def _reference(folder: str, adapters: str, seed: int):
    from diffusers import HeliosPipeline

    from models.helios.loading import load_helios

    c = load_helios(folder)
    pipe = HeliosPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, scheduler=c.scheduler,
                          transformer=c.transformer)
    pipe.set_progress_bar_config(disable=True)
    for name in ("a", "b"):
        pipe.load_lora_weights(adapters, weight_name=f"{name}.safetensors", adapter_name=name)
    out = []
    for loras in SEQUENCE:
        if loras:
            pipe.set_adapters([n for n, _ in loras], [s for _, s in loras])
            pipe.enable_lora()
        else:
            pipe.disable_lora()
        r = _request(seed, ())
        frames = pipe(prompt=r.prompt, negative_prompt=r.negative_prompt, num_frames=r.num_frames, height=r.height,
                      width=r.width, num_inference_steps=r.num_inference_steps, guidance_scale=r.guidance_scale,
                      num_latent_frames_per_chunk=3, generator=torch.Generator("cpu").manual_seed(r.seed),
                      output_type="np").frames[0]
        out.append((np.clip(frames, 0, 1) * 255).round().astype(np.uint8))
    return out


@pytest.fixture(scope="module")
def one_rank(setup):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(_run, single_process_state(), *setup, seed)


def test_one_rank_equals_the_pipeline_with_its_adapters(setup, one_rank):
    seed, (runs, (before, after)) = one_rank
    ours = [frames for frames, _ in runs]
    assert before == after, "the base weights changed"
    reference = one_thread(_reference, *setup, seed)
    for loras, frames, ref in zip(SEQUENCE, ours, reference, strict=True):
        np.testing.assert_array_equal(frames, ref, err_msg=f"{loras} seed={seed}")
    assert not np.array_equal(ours[0], ours[1]), "adapter a changes nothing: the comparison would prove little"
    assert not np.array_equal(ours[0], ours[2]), "adapter b changes nothing: the comparison would prove little"


def test_two_ranks_equal_one_rank_with_adapters(setup, one_rank, groups):
    seed, (runs, _) = one_rank
    both = SEQUENCE.index((("a", 0.8), ("b", -1.5)))
    results = groups(2).run(_run, *setup, seed, SEQUENCE[both:both + 1], timeout=600)
    assert_ranks_close(runs[both:both + 1], [out for out, _ in results], world=2, seed=seed)
    assert all(before == after for _, (before, after) in results), "the base weights changed"

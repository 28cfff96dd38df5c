"""Helios text-to-video sampled with the Ulysses engine, chunk by chunk: 1 rank equals diffusers' own
HeliosPipeline, N ranks and guidance ranks equal 1 rank.

tiny-helios has 5 heads (they divide neither 2 nor 3 ranks: padded heads). A chunk's self-attention sequence is its
history's tokens and its own, sharded together: at 32x32 (4x4 latents, 2x2 patches) a chunk of 3 latent frames is
12 tokens, the short history (the first latent frame and 1 more) 8, the mid history (2 frames, patches of 2x4x4) 1,
the long history (16 frames, 4x8x8) 4: 25 tokens, which divide neither 2 nor 3. At 48x48 with history_sizes
(8, 2, 1) (given as [2, 8, 1]: the pipeline sorts them) the chunk is 27 tokens (the engine's own shard of the chunk
uneven at 2 ranks), the short history 18, the mid 4, the long 2: 51.

Tolerances: at 1 rank our loop runs diffusers' own modules on the same tensors in the same order (the transformer's
forward on the chunk's grid, the scheduler stepping the same values in another layout, each chunk decoded alone by
``vae.decode``), so frames and latents are bit-identical to ``HeliosPipeline``. With N Ulysses ranks the maths is the
same but matmuls over fewer rows and SDPA over the exchanged layout may sum in another order: fp32 differences of
~1e-6, carried through the chunks' histories, that can flip a rounding to uint8, so frames agree within 1 level and
on average within 0.01, latents within 1e-4. Guidance ranks run each pass as the pipeline does (a batch of one) and
exchange the outputs unchanged: bit-identical.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cp_infer.request import Condition, GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...harness import one_thread
from ...worker_groups import SharedGroup, groups_by_layout
from .._parity import assert_ranks_close, text_projection_calls

groups = groups_by_layout()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from models.helios.default import ensure_default_helios_model

    return str(ensure_default_helios_model(tmp_path_factory.mktemp("helios")))


def _picture(seed: int, frames: int = 1) -> np.ndarray:
    """A picture (or a clip of it panning right, ``frames`` long) with fresh noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:40, 0:56]
    clip = [np.stack([((x + 3 * f) * 5) % 256, (y * 7) % 256, (x + 3 * f + 2 * y) % 256], axis=-1)
            + rng.integers(-30, 30, (40, 56, 3)) for f in range(frames)]
    return np.clip(np.stack(clip), 0, 255).astype(np.uint8)


def _requests(seed: int) -> list[GenerationRequest]:
    # Two chunks with CFG (25 tokens a chunk); one chunk without (one pass a step), a shorter long history (51); two
    # chunks from an image (its latents and still frame encoded and noised from the request's generator).
    return [
        GenerationRequest(prompt="a red fox runs through fresh snow", negative_prompt="blurry, low quality",
                          num_frames=17, height=32, width=32, num_inference_steps=2, guidance_scale=4.0, seed=seed,
                          options={"num_latent_frames_per_chunk": 3}),
        GenerationRequest(prompt="waves on a beach at dusk", num_frames=9, height=48, width=48,
                          num_inference_steps=2, guidance_scale=1.0, seed=seed + 1,
                          options={"num_latent_frames_per_chunk": 3, "history_sizes": [2, 8, 1]}),
        GenerationRequest(prompt="the fox turns its head", num_frames=17, height=32, width=32,
                          num_inference_steps=2, guidance_scale=3.0, seed=seed + 2,
                          image=Condition(frames=_picture(seed)),
                          options={"num_latent_frames_per_chunk": 3, "image_noise_sigma_max": 0.3}),
        # Video-to-video: a clip of 17 frames is one whole chunk of 9 (its first 8 dropped, as the pipeline drops
        # them), its latents the history's last 3 frames after 16 of zeros.
        GenerationRequest(prompt="the fox keeps running", num_frames=17, height=32, width=32,
                          num_inference_steps=2, guidance_scale=1.0, seed=seed + 3,
                          conditions=(Condition(frames=_picture(seed + 3, 17)),),
                          options={"num_latent_frames_per_chunk": 3, "video_noise_sigma_max": 0.3}),
    ]


def _sample_all(state, folder: str, seed: int, first: int | None = None):
    """``first``: only that many of the requests."""
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    model = HeliosModel(load_helios(folder), state=state)
    out = []
    for request in _requests(seed)[:first]:
        latents = {}
        frames = sample(model, request, state=state, control=SampleControl(on_latents=latents.update))
        out.append((frames, latents.get("latents")))
    return out


def _reference(folder: str, r: GenerationRequest, output_type: str) -> np.ndarray:
    from diffusers import HeliosPipeline

    from models.helios.loading import load_helios

    c = load_helios(folder)
    pipe = HeliosPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, scheduler=c.scheduler,
                          transformer=c.transformer)
    pipe.set_progress_bar_config(disable=True)
    from PIL import Image

    image = None if r.image is None else Image.fromarray(r.image.frames[0], mode="RGB")
    video = [Image.fromarray(f, mode="RGB") for f in r.conditions[0].frames] if r.conditions else None
    out = pipe(prompt=r.prompt, negative_prompt=r.negative_prompt or None, num_frames=r.num_frames, image=image,
               video=video,
               height=r.height, width=r.width, num_inference_steps=r.num_inference_steps,
               guidance_scale=r.guidance_scale, generator=torch.Generator("cpu").manual_seed(r.seed),
               output_type=output_type, **r.options).frames
    if output_type == "latent":
        return out.float().numpy()
    return (np.clip(out[0], 0, 1) * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def one_rank(folder):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(_sample_all, single_process_state(), folder, seed)


def test_one_rank_equals_helios_pipeline(folder, one_rank):
    seed, ours = one_rank
    for r, (frames, latents) in zip(_requests(seed), ours, strict=True):
        assert frames.shape == (r.num_frames, r.height, r.width, 3)
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        # The reference on one thread too, as ours: the thread count alone changes how a matmul's sum is split.
        np.testing.assert_array_equal(latents, one_thread(_reference, folder, r, "latent"), err_msg=f"seed={seed}")
        np.testing.assert_array_equal(frames, one_thread(_reference, folder, r, "np"), err_msg=f"seed={seed}")


@pytest.mark.parametrize("world", [2, 3])
def test_n_ranks_equal_one_rank(folder, one_rank, groups, world):
    seed, expected = one_rank
    results = groups(world).run(_sample_all, folder, seed, timeout=600)
    assert_ranks_close(expected, results, world=world, seed=seed)


def test_a_ring_of_two_equals_one_rank(folder, one_rank):
    """R=2 (``--ring-degree 2``): the chunk and its history pass their key/value blocks round the ring, the history's
    keys amplified in every block; the first request (2 chunks, CFG) only, to keep the test short."""
    seed, expected = one_rank
    results = SharedGroup(2, ring=2).run(_sample_all, folder, seed, 1, timeout=600)
    assert_ranks_close(expected[:1], results, world="R2", seed=seed)


def test_guidance_ranks_equal_one_rank(folder, one_rank, groups):
    """G=2: CFG's conditional pass on one rank, the unconditional on the other (the second request has no CFG: one
    pass, the second rank idle but in the exchange)."""
    seed, expected = one_rank
    results = groups(2, 2).run(_sample_all, folder, seed, timeout=600)
    assert_ranks_close(expected, results, world=2, seed=seed, exact=True)


def _decode_three_chunks(state, folder: str, frames_per_rank):
    """Three chunks of 5 latent frames (51 frames, cut to 49), their latents random, decoded over the group as the
    sampler decodes a Helios video (fed as a checkpoint of two chunks is, then the third): the frames on rank 0, and
    the latent frames this rank put through the VAE's decoder."""
    from cp_infer.decode import ProgressiveDecode
    from cp_infer.request import resolve_request
    from cp_infer.sampler import Prepared
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    model = HeliosModel(load_helios(folder), state=state)
    model.decode_frames_per_rank = frames_per_rank
    request = resolve_request(GenerationRequest(prompt="a fox", num_frames=49, height=48, width=48,
                                                options={"num_latent_frames_per_chunk": 5}), model.options)
    made = torch.randn((1, 16, 15, 6, 6), generator=torch.Generator().manual_seed(7))
    arrays = {"made": made[:, :, :10].numpy(), "history": np.zeros((1, 16, 19, 6, 6), np.float32),
              "first": np.zeros((1, 16, 1, 6, 6), np.float32), "chunk": np.array(1),
              "generator": torch.Generator().get_state().numpy()}
    x, final = model.restore(request, arrays)
    decoder = model.decoder({}, Prepared(latents={}, timesteps=(), state=x))
    stream = ProgressiveDecode(decoder.split, decoder.decode_range, frame_shape=decoder.frame_shape,
                               state=state.decoding, reads=decoder.reads)
    seen: list[int] = []
    model.components.vae.decoder.conv_in.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[2]))
    decoder.feed(x, final)
    frames = list(stream.advance(final))
    x.history.made.append(made[:, :, 10:])
    decoder.feed(x, 15)
    frames += list(stream.advance(None))
    return (np.concatenate(frames) if frames else None), sum(seen), made


@pytest.mark.parametrize(("world", "frames_per_rank"), [(2, 1), (3, "auto")])
def test_each_chunk_is_decoded_over_the_ranks_as_vae_decode_decodes_it(folder, groups, world, frames_per_rank):
    """The decode is the pipeline's (each chunk alone through ``vae.decode``, post-processed, cut to 4k + 1), bit for
    bit, with every chunk's latent frames cut over the ranks (rounds of 1 latent frame per rank at 2 ranks: a chunk's
    pieces hand each other the VAE's caches across rounds; ``auto`` at 3: a round of all) and none decoded twice."""
    from diffusers import HeliosPipeline

    from models.helios.loading import load_helios

    results = groups(world).run(_decode_three_chunks, folder, frames_per_rank, timeout=300)
    frames, _, made = results[0]
    c = load_helios(folder)
    pipe = HeliosPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, scheduler=c.scheduler,
                          transformer=c.transformer)
    vae = c.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    with torch.no_grad():
        video = torch.cat([vae.decode(chunk / inverse_std + mean, return_dict=False)[0]
                           for chunk in made.split(5, dim=2)], dim=2)[:, :, :49]
    expected = (np.clip(pipe.video_processor.postprocess_video(video, output_type="np")[0], 0, 1) * 255).round()
    np.testing.assert_array_equal(frames, expected.astype(np.uint8))
    decoded = [n for _, n, _ in results]
    assert sum(decoded) == 15 and all(0 < n < 15 for n in decoded), decoded


def _live_three_chunks(state, folder: str, seed: int):
    """A live video of three chunks of 5 latent frames at 48x48, directed a chunk at a time, and the one request of
    the same directions: both videos (rank 0), the frames delivered live, and the latent frames this rank put
    through the VAE's decoder in the live run."""
    from cp_infer.live import WAIT, Direction, live_request
    from cp_infer.request import resolve_request
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    model = HeliosModel(load_helios(folder), state=state)
    model.decode_frames_per_rank = 1
    base = resolve_request(GenerationRequest(
        prompt="a red fox runs through fresh snow", num_frames=17, height=48, width=48, num_inference_steps=2,
        guidance_scale=1.0, seed=seed, options={"num_latent_frames_per_chunk": 5}), model.options)
    directions = [Direction(base.prompt, 1), Direction("the fox jumps", 1), Direction("night falls", 1)]
    whole = sample(model, live_request(base, directions, model.options), state=state)
    told = [WAIT, live_request(base, directions[:2], model.options), live_request(base, directions, model.options),
            None]
    delivered: list[tuple[int, int]] = []
    seen: list[int] = []
    model.components.vae.decoder.conv_in.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[2]))
    control = SampleControl(live=True, extend=lambda done, request: told.pop(0),
                            on_frames=lambda f, first, total: delivered.append((first, len(f))))
    frames = sample(model, live_request(base, directions[:1], model.options), state=state, control=control)
    return whole, frames, delivered, sum(seen)


def test_a_live_video_over_two_ranks_decodes_each_chunk_once(folder, groups):
    """At 2 ranks each chunk's decode is cut over both; when the video grows, the decode goes on at the next chunk
    (its first round starts afresh) instead of decoding the video again: every latent frame goes through the VAE
    once, every frame is delivered once and in order, and the video is the one request's."""
    seed = random.randrange(2**31)
    results = groups(2).run(_live_three_chunks, folder, seed, timeout=300)
    whole, frames, delivered, _ = results[0]
    assert whole.shape[0] == 49
    np.testing.assert_array_equal(frames, whole, err_msg=f"seed={seed}")
    firsts = [first for first, _ in delivered]
    assert firsts == sorted(set(firsts)) and sum(n for _, n in delivered) == 49, delivered
    decoded = [r[3] for r in results]
    assert sum(decoded) == 15 and all(decoded), decoded


def _text_projections(state, folder: str) -> dict[str, int]:
    """The calls of block 0's cross-attention key projection and of the text embedder over a request of two chunks
    of two steps each, with CFG."""
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    model = HeliosModel(load_helios(folder), state=state)
    calls = text_projection_calls(model.transformer)
    request = GenerationRequest(prompt="a fox", num_frames=17, height=32, width=32, num_inference_steps=2,
                                guidance_scale=3.0, seed=1, options={"num_latent_frames_per_chunk": 3})
    sample(model, request, state=state)
    return calls


@pytest.mark.parametrize("world", [1, 2])
def test_text_keys_and_values_are_projected_once_per_request(folder, groups, world):
    """Each block's cross-attention projects the text's keys and values once per prompt of a request (CFG: the
    conditional and the unconditional), not at every step of every chunk; the text embedder runs once per prompt."""
    from cp_infer import single_process_state

    results = [_text_projections(single_process_state(), folder)] if world == 1 else \
        groups(world).run(_text_projections, folder, timeout=300)
    assert results == [{"to_k": 2, "text_embedder": 2}] * world


def test_embedded_default_builds_bit_for_bit():
    from models.helios.default import build_helios_pipeline

    a, b = build_helios_pipeline(), build_helios_pipeline()
    for name in ("transformer", "vae", "text_encoder"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name


@pytest.mark.parametrize("index", [0, 2, 3], ids=["text", "image", "video"])
def test_chunks_stream_and_a_resumed_job_equals_the_whole_run(folder, one_rank, index):
    """Each chunk's frames are delivered once it is made, before the next; after it the job is a checkpoint, and going
    on from it (the chunks made decoded again, the next drawn from the generator's saved state) makes the video and
    latents of the uninterrupted run, bit for bit. A checkpoint of another request is refused."""
    from cp_infer import single_process_state
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    seed, ours = one_rank
    request = _requests(seed)[index]  # two chunks of 9 frames: 17 frames
    state = single_process_state()
    model = HeliosModel(load_helios(folder), state=state)
    saved, events = {}, []
    control = SampleControl(on_checkpoint=saved.__setitem__, on_pass=lambda i, plan: events.append(("pass", i)),
                            on_frames=lambda frames, first, total: events.append(("frames", first, len(frames))))
    one_thread(sample, model, request, state=state, control=control)
    assert sorted(saved) == [1]
    delivered = [e for e in events[:events.index(("pass", 1))] if e[0] == "frames"]
    # The first chunk's 9 frames (pieces of 4 after the first frame: 1 + 4 + 4), before the second is made.
    assert sum(n for _, _, n in delivered) == 9, events
    latents = {}
    frames = one_thread(sample, model, request, state=state,
                        control=SampleControl(resume=(1, saved[1]), on_latents=latents.update))
    np.testing.assert_array_equal(frames, ours[index][0], err_msg=f"seed={seed}")
    np.testing.assert_array_equal(latents["latents"], ours[index][1], err_msg=f"seed={seed}")
    other = GenerationRequest(**{**request.__dict__, "height": 48})
    with pytest.raises(Exception, match="checkpoint"):
        one_thread(sample, model, other, state=state, control=SampleControl(resume=(1, saved[1])))


def test_prompt_segments_give_each_range_of_chunks_its_prompt(folder, one_rank):
    """With prompt_segments (the windows' option, its windows the chunks), chunk 0 is made from its segment's text
    and chunk 1 from the next's: the first chunk's latents are those of the whole-video prompt when its segment is that
    prompt, and the second's differ from them; segments that all say the prompt make the one-prompt video."""
    from cp_infer import single_process_state
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    seed, ours = one_rank
    request = _requests(seed)[0]  # two chunks of 3 latent frames
    state = single_process_state()
    model = HeliosModel(load_helios(folder), state=state)

    def latents_of(segments):
        options = {**request.options, "prompt_segments": segments}
        got = {}
        one_thread(sample, model, GenerationRequest(**{**request.__dict__, "options": options}), state=state,
                   control=SampleControl(on_latents=got.update))
        return got["latents"]

    same = latents_of([{"start_window": 0, "end_window": 1, "text": request.prompt}])
    np.testing.assert_array_equal(same, ours[0][1], err_msg=f"seed={seed}")
    split = latents_of([{"start_window": 0, "text": request.prompt}, {"start_window": 1, "text": "a city at night"}])
    np.testing.assert_array_equal(split[:, :, :3], ours[0][1][:, :, :3], err_msg=f"seed={seed}")
    assert np.abs(split[:, :, 3:] - ours[0][1][:, :, 3:]).max() > 1e-3, "the second chunk's prompt changed nothing"


def test_a_live_video_equals_the_one_request_video(folder, one_rank):
    """A live video (``cp_infer.live``) directed one chunk at a time, waiting between directions, makes the video and
    latents of the one request with the same prompt_segments, bit for bit, streaming each chunk's frames once (the
    decode goes on where it stopped when the video grows); going on from the checkpoint taken as it grew makes it
    too."""
    from cp_infer import single_process_state
    from cp_infer.live import WAIT, Direction, live_request
    from cp_infer.request import resolve_request
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    seed, _ = one_rank
    state = single_process_state()
    model = HeliosModel(load_helios(folder), state=state)
    base = resolve_request(GenerationRequest(
        prompt="a red fox runs through fresh snow", num_frames=9, height=32, width=32, num_inference_steps=2,
        guidance_scale=4.0, seed=seed, options={"num_latent_frames_per_chunk": 3}), model.options)
    directions = [Direction(base.prompt, 1), Direction("the fox jumps", 2), Direction("night falls", 1)]
    whole = live_request(base, directions, model.options)
    assert whole.num_frames == 33 and len(whole.options["prompt_segments"]) == 3
    latents, expected = {}, {}
    frames_whole = one_thread(sample, model, whole, state=state, control=SampleControl(on_latents=expected.update))
    # The hook's answers: nothing yet twice, then each direction; the end once the last is made.
    answers = [WAIT, WAIT, live_request(base, directions[:2], model.options), WAIT,
               live_request(base, directions, model.options), None]
    asked, delivered, checkpoints = [], [], {}

    def extend(passes_done, request):
        asked.append((passes_done, request.num_frames))
        return answers.pop(0)

    control = SampleControl(live=True, extend=extend, on_latents=latents.update, on_checkpoint=checkpoints.__setitem__,
                            on_frames=lambda f, first, total: delivered.append((first, len(f), total)))
    frames = one_thread(sample, model, live_request(base, directions[:1], model.options), state=state,
                        control=control)
    assert asked == [(1, 9), (1, 9), (1, 9), (3, 25), (3, 25), (4, 33)], asked
    assert sorted(checkpoints) == [1, 2, 3]  # after every chunk but the last
    firsts = [first for first, _, _ in delivered]
    assert firsts == sorted(set(firsts)) and sum(n for _, n, _ in delivered) == 33, delivered
    np.testing.assert_array_equal(latents["latents"], expected["latents"], err_msg=f"seed={seed}")
    np.testing.assert_array_equal(frames, frames_whole, err_msg=f"seed={seed}")
    # A live job restarted after a crash: its last checkpoint (taken as the video grew) with every direction it took.
    resumed = one_thread(sample, model, whole, state=state, control=SampleControl(resume=(3, checkpoints[3])))
    np.testing.assert_array_equal(resumed, frames_whole, err_msg=f"seed={seed}")

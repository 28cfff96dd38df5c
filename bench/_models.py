"""The benchmark models the scripts share, their requests and our runner.

- LTX-Video: diffusers' ``LTXVideoTransformer3DModel`` at a :class:`ModelSize`, the embedded default model's other
  components (``models.ltx_video.default.build_default_components``: a tiny T5 and a tiny VAE with LTX-Video's real
  compression, 8x time and 32x space) and its scheduler; the workloads of ``bench/generate.py`` and
  ``bench/conditioning.py``; :class:`OursRunner`, our engine over it, which keeps the final latents.
- LTX-2: diffusers' ``LTX2VideoTransformer3DModel`` at 2 layers x 8 heads x 64 (audio 8 x 32) with the other
  components of ``tiny-ltx2``, and ``LTX2Pipeline``'s default guidance.
- Wan 2.1 text-to-video: diffusers' ``WanTransformer3DModel`` at the same :class:`ModelSize` (feed-forward 4x the
  inner width, as LTX-Video's; patch 1x2x2) with ``tiny-wan``'s other components (a tiny UMT5, a tiny Wan VAE with
  Wan's real compression, 4x time and 8x space, and its UniPC scheduler); the Wan workloads of ``bench/generate.py``
  have the LTX-Video workloads' latent token grids (4 x 8 x 16 and 16 x 16 x 16 tokens).

The families' differences sit in tables, one per concern: :data:`BENCH_FAMILIES` (what the text-to-video
benchmarks need of LTX-Video and Wan: components, requests, runners, workload shapes) and :data:`GUIDED` (the
medium models' prompts and guidance); what ``models.families`` knows (transformer and pipeline classes, the adapter)
is asked there.

Invariants: every process builds the same weights (LTX-Video: torch's own init under :data:`SEED`, the global RNG
forked; LTX-2: ``models.common.embedded.init_deterministic`` from :data:`SEED`); everything is fp32.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = [
    "BENCH_FAMILIES", "COMM", "COMPUTE", "FPS", "GUIDANCE", "GUIDED", "LATENT_TOL", "LTX2", "LTX2_GUIDANCE",
    "LTX2_HEADS", "LTX2_HEAD_DIM", "LTX2_LAYERS", "LTX2_NEGATIVE", "LTX2_PROMPT", "LTX_VIDEO", "MEDIUM", "MEDIUM_LABEL",
    "NEGATIVE", "PROMPT", "SEED", "SHORT_WIDE", "WAN", "BenchFamily", "ModelSize", "OursRunner", "Workload",
    "build_components", "build_ltx2_components", "make_request", "model_sizes", "save_folder", "workloads",
    "write_medium_folder",
]

SEED = 1234
FPS = 24
LATENT_TOL = 1e-3
"""fp32 throughout. N ranks run the same maths as 1 rank, but matmuls over fewer rows with another thread count
and SDPA over another head grouping may sum in another order (~1e-6 relative per op); over a few steps of a
random transformer that stays far below 1e-3 absolute on latents of unit scale."""

LTX_VIDEO, LTX2, WAN = "ltx-video", "ltx2", "wan"
"""``models.families`` names."""
COMM, SHORT_WIDE, COMPUTE = "comm-bound", "short, wide model", "compute-bound"

PROMPT = "a red fox runs through fresh snow at dawn, cinematic tracking shot"
NEGATIVE = "blurry, low quality"
GUIDANCE = 3.0

LTX2_PROMPT = "a drummer plays on a rainy street at night, close-up, cinematic"
LTX2_NEGATIVE = "silence, blurry, low quality"
LTX2_GUIDANCE = dict(guidance_scale=3.0, audio_guidance_scale=7.0, stg_scale=1.0, audio_stg_scale=1.0,
                     modality_scale=3.0, audio_modality_scale=3.0, guidance_rescale=0.7,
                     audio_guidance_rescale=0.7)
"""``LTX2Pipeline``'s defaults."""
LTX2_LAYERS, LTX2_HEADS, LTX2_HEAD_DIM = 2, 8, 64  # the benchmark transformer; audio: heads x head_dim // 2

GUIDED = {LTX_VIDEO: dict(prompt=PROMPT, negative_prompt=NEGATIVE, guidance_scale=GUIDANCE),
          LTX2: dict(prompt=LTX2_PROMPT, negative_prompt=LTX2_NEGATIVE, stages=1, **LTX2_GUIDANCE)}
"""Family -> the request values of its medium model (``bench/cache.py``, ``bench/memory.py``): prompts and its
pipeline's guidance (LTX-2: one stage, the benchmark folders come without a latent upsampler)."""


def _family(name: str) -> Any:
    from models.families import family

    return family(name)


# ---------------------------------------------------------------------------------------------------------
# The text-to-video benchmark models and workloads (LTX-Video, Wan).
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """The benchmark transformer's shape."""

    layers: int
    heads: int
    head_dim: int = 64
    channels: int = 16
    """Latent channels: must match the default model's VAE."""

    def __post_init__(self) -> None:
        if self.layers < 1 or self.heads < 1:
            raise ValueError(f"layers={self.layers} and heads={self.heads} must be >= 1 (odd heads: Ulysses over 2 "
                             "ranks pads one)")

    def describe(self, params: int, family: str = LTX_VIDEO) -> str:
        cls = _family(family).transformers[0]
        return (f"`{cls}`, {self.layers} layers, {self.heads} heads x {self.head_dim} dim "
                f"(inner {self.heads * self.head_dim}), {self.channels} latent channels, {params / 1e6:.1f} M params")


MEDIUM = ModelSize(layers=4, heads=16)
"""The medium LTX-Video of the whole-process benchmarks (``bench/cli.py``, ``bench/serve_batch.py``) and of
``bench/compile.py``: the transformer dominates, as on a real checkpoint."""
MEDIUM_LABEL = f"LTX-Video {MEDIUM.layers} layers x {MEDIUM.heads} heads x {MEDIUM.head_dim}, tiny T5 and VAE"


@dataclass(frozen=True)
class Workload:
    name: str
    frames: int
    height: int
    width: int
    model: ModelSize
    target: bool = True
    """Whether the issue's targets are read off this workload (``False``: reported for context only)."""
    family: str = LTX_VIDEO
    """A :data:`BENCH_FAMILIES` key: which transformer and pipeline (:func:`build_components`)."""

    def tokens(self) -> int:
        from cp_infer import VideoGeometry

        geometry = VideoGeometry(**BENCH_FAMILIES[self.family].geometry)
        return geometry.latent_shape(self.frames, self.height, self.width).tokens


@dataclass(frozen=True)
class BenchFamily:
    """What the text-to-video benchmarks (``bench/generate.py``, ``bench/conditioning.py``, ``bench/compile.py``,
    ``bench/layout.py``) need of one family: a row of :data:`BENCH_FAMILIES`."""

    title: str
    """How the reports name the model the benchmark follows."""
    prefix: str
    """What its workloads' names start with."""
    geometry: dict[str, int]
    """``VideoGeometry``'s arguments: its VAE's compression, its transformer's patch."""
    short: tuple[int, int, int]
    """Frames, height, width of its 512-token workloads (4 x 8 x 16 latent tokens)."""
    long: tuple[int, int, int]
    """Frames, height, width of its 4096-token workload (16 x 16 x 16)."""
    build: Callable[[ModelSize], Any]
    """Its pipeline's components around the benchmark transformer at a size."""
    request: Callable[[Workload, int, dict[str, Any]], Any]
    """``(workload, steps, values)``: the workload's request, resolved against its declared options."""
    transformer: Callable[[Any], Any]
    """The transformer of :attr:`build`'s components."""
    ours: Callable[[Any, Any], Any]
    """``(components, state)``: our adapter over them (``models.families``' ``wrap``)."""
    latents: Callable[[Any, dict[str, Any], Any], Any]
    """``(adapter, latents, prepared)``: the final latents the sampler hands to the decode, as the reports compare
    them."""
    diffusers: Callable[..., Any]
    """``(components, ranks=, tokens=)``: diffusers' own pipeline over them (``bench/peers/diffusers_cp.py``)."""


def _ltx_video_components(size: ModelSize) -> dict[str, Any]:
    """``LTXPipeline``'s components (a dict): the benchmark transformer at ``size`` around the embedded default's
    others."""
    import torch
    from diffusers import LTXVideoTransformer3DModel

    from models.ltx_video.default import build_default_components

    components = build_default_components()
    inner = size.heads * size.head_dim
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = LTXVideoTransformer3DModel(
            in_channels=size.channels, out_channels=size.channels, patch_size=1, patch_size_t=1,
            num_attention_heads=size.heads, attention_head_dim=size.head_dim, cross_attention_dim=inner,
            num_layers=size.layers, caption_channels=components["text_encoder"].config.d_model,
        )
    components["transformer"] = transformer.eval()
    return components


def _ltx_video_request(workload: Workload, steps: int, values: dict[str, Any]) -> Any:
    from cp_infer.request import GenerationRequest, resolve_request
    from models.ltx_video.options import ltx_video_options

    options = ltx_video_options()
    # NOTE(one-window): one sequence, as LTXPipeline makes it. Ours makes a video longer than temporal_tile_size
    # window by window, so a longer workload gets a window as long as the video ((frames + 7) // 8 latent frames).
    tile = next(o.default for o in options if o.name == "temporal_tile_size")
    values = {"temporal_tile_size": max(tile, workload.frames + 7), **values}
    req = GenerationRequest.of(prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=workload.frames,
                               height=workload.height, width=workload.width, num_inference_steps=steps,
                               guidance_scale=GUIDANCE, seed=SEED, fps=FPS, max_sequence_length=128, **values)
    return resolve_request(req, options)


def _ltx_video_diffusers(components: dict[str, Any], *, ranks: int, tokens: int) -> Any:
    from bench.peers.diffusers_cp import DiffusersRunner

    return DiffusersRunner(components, ranks=ranks)


def _wan_components(size: ModelSize) -> Any:
    """``WanPipeline``'s components, as ``models.wan.loading.WanComponents``, around ``tiny-wan``'s."""
    import torch
    from diffusers import WanTransformer3DModel

    from models.wan.default import build_wan_pipeline
    from models.wan.loading import WanComponents

    pipe = build_wan_pipeline("t2v")
    inner = size.heads * size.head_dim
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=size.heads, attention_head_dim=size.head_dim,
            in_channels=size.channels, out_channels=size.channels, text_dim=pipe.text_encoder.config.d_model,
            freq_dim=256, ffn_dim=4 * inner, num_layers=size.layers, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
    return WanComponents(transformer=transformer.eval(), vae=pipe.vae, scheduler=pipe.scheduler,
                         text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, path=Path("."),
                         dtype=torch.float32, device=torch.device("cpu"))


def _wan_request(workload: Workload, steps: int, values: dict[str, Any]) -> Any:
    from cp_infer.request import GenerationRequest, resolve_request
    from models.wan.options import wan_options

    req = GenerationRequest.of(prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=workload.frames,
                               height=workload.height, width=workload.width, num_inference_steps=steps,
                               guidance_scale=GUIDANCE, seed=SEED, max_sequence_length=128, **values)
    return resolve_request(req, wan_options())


def _wan_latents(model: Any, latents: dict[str, Any], prepared: Any) -> Any:
    """The pipeline's final ``[B, C, F, H, W]`` latents, as ``WanPipeline`` has them."""
    import torch

    return torch.from_numpy(model.output_latents(latents, prepared)["latents"])


def _wan_diffusers(components: Any, *, ranks: int, tokens: int) -> Any:
    from bench.peers.diffusers_cp import DiffusersWanRunner

    return DiffusersWanRunner(components, ranks=ranks, tokens=tokens)


BENCH_FAMILIES: dict[str, BenchFamily] = {
    LTX_VIDEO: BenchFamily(
        title="LTX-Video", prefix="", geometry={}, short=(25, 256, 512), long=(121, 512, 512),
        build=_ltx_video_components, request=_ltx_video_request, transformer=lambda c: c["transformer"],
        ours=lambda c, state: _family(LTX_VIDEO).wrap(SimpleNamespace(**c), state=state),
        latents=lambda _model, latents, _prepared: latents["video"].clone(),  # packed [B, S, C]
        diffusers=_ltx_video_diffusers),
    # Wan 2.1 text-to-video: Wan's VAE compresses 4x in time and 8x in space, its transformer patches 1x2x2.
    WAN: BenchFamily(
        title="Wan 2.1", prefix="wan ", geometry=dict(temporal_compression=4, spatial_compression=8, patch_size=2),
        short=(13, 128, 256), long=(61, 256, 256), build=_wan_components, request=_wan_request,
        transformer=lambda c: c.transformer, ours=lambda c, state: _family(WAN).wrap(c, state=state),
        latents=_wan_latents, diffusers=_wan_diffusers),
}
"""Family -> what the text-to-video benchmarks need of it; the order is the reports' order."""


def model_sizes(*, quick: bool, layers: int | None = None, heads: int | None = None) -> tuple[ModelSize, ModelSize]:
    """(wide, narrow): wide 2 layers x 16 heads (``--quick``: 1 x 8), ``layers``/``heads`` overriding; narrow 8
    layers x 2 heads (``--quick``: 4 layers). ``bench/generate.py``'s docstring says why these two."""
    wide = ModelSize(layers=layers or (1 if quick else 2), heads=heads or (8 if quick else 16))
    return wide, ModelSize(layers=4 if quick else 8, heads=2)


def workloads(wide: ModelSize, narrow: ModelSize, family: str = LTX_VIDEO) -> tuple[Workload, ...]:
    """comm-bound (narrow model, 512 tokens), the same 512 tokens on the wide model (context, no target),
    compute-bound (wide model, 4096 tokens), on ``family``'s transformer: the same latent token grids for every
    family (LTX-Video: 25 frames at 256x512 and 121 at 512x512; Wan: 13 at 128x256 and 61 at 256x256)."""
    b = BENCH_FAMILIES[family]
    return (Workload(b.prefix + COMM, *b.short, model=narrow, family=family),
            Workload(b.prefix + SHORT_WIDE, *b.short, model=wide, target=False, family=family),
            Workload(b.prefix + COMPUTE, *b.long, model=wide, family=family))


def build_components(size: ModelSize, family: str = LTX_VIDEO) -> Any:
    """``family``'s pipeline components around the benchmark transformer at ``size`` (LTX-Video: ``LTXPipeline``'s,
    a dict; Wan: ``WanPipeline``'s, as ``models.wan.loading.WanComponents``)."""
    return BENCH_FAMILIES[family].build(size)


def save_folder(family: str, components: dict[str, Any], folder: Path) -> None:
    """``components`` written as a folder of ``family``'s pipeline (``save_pretrained``)."""
    import diffusers

    getattr(diffusers, _family(family).pipelines[0])(**components).save_pretrained(folder)


_MEDIUM: dict[str, Callable[[], Any]] = {LTX_VIDEO: lambda: build_components(MEDIUM),
                                         LTX2: lambda: build_ltx2_components()}
"""Family -> its medium model's components: LTX-Video's with the :data:`MEDIUM` transformer, LTX-2's with the
benchmark transformer of :func:`build_ltx2_components`."""


def write_medium_folder(folder: Path, family: str = LTX_VIDEO) -> None:
    """A folder of ``family``'s medium model (:data:`_MEDIUM`)."""
    save_folder(family, _MEDIUM[family](), folder)


def make_request(workload: Workload, steps: int, **values: Any):
    """The workload's request, resolved against its family's declared options (diffusers' runner reads them all)."""
    return BENCH_FAMILIES[workload.family].request(workload, steps, values)


class _Recording:
    """Our model adapter, unchanged, except that it keeps the final latents the sampler hands to the decode."""

    def __init__(self, model: Any, final: Callable[[Any, dict[str, Any], Any], Any]) -> None:
        self._model, self._final, self.latents = model, final, None

    def __getattr__(self, name: str) -> Any:  # geometry, prepare, predict, step: the adapter's own
        return getattr(self._model, name)

    def decoder(self, latents, prepared):
        self.latents = self._final(self._model, latents, prepared)
        return self._model.decoder(latents, prepared)


class OursRunner:
    """``cp_infer.sampler.sample`` over ``family``'s adapter around :func:`build_components`' components; a call
    returns the uint8 frames, the final latents (LTX-Video: packed; Wan: ``[B, C, F, H, W]``), the step times and
    the time from the call to the first step's start."""

    def __init__(self, components: Any, *, state: Any, family: str = LTX_VIDEO) -> None:
        self.state = state
        bench = BENCH_FAMILIES[family]
        self.model = _Recording(bench.ours(components, state), bench.latents)

    def __call__(self, request: Any, on_last_step: Any) -> dict[str, Any]:
        from cp_infer.sampler import SampleControl, sample

        record: dict[str, Any] = {"steps": []}
        called = time.perf_counter()

        def on_step(done: int, total: int, seconds: float) -> None:
            if done == 1:  # from the call to the first step's start: checks, prepare (text and media encode), shard
                record["before_first_step_s"] = time.perf_counter() - seconds - called
            record["steps"].append(seconds)
            if done == total:
                on_last_step()

        self.model.latents = None
        record["frames"] = sample(self.model, request, state=self.state, control=SampleControl(on_step=on_step))
        record["latents"] = None if self.model.latents is None else self.model.latents.numpy()
        return record


# ---------------------------------------------------------------------------------------------------------
# LTX-2.
# ---------------------------------------------------------------------------------------------------------


def build_ltx2_components() -> dict[str, Any]:
    """``LTX2Pipeline``'s components: the benchmark transformer (RoPE "interleaved") around ``tiny-ltx2``'s
    others."""
    from diffusers import LTX2VideoTransformer3DModel

    from models.common.embedded import init_deterministic
    from models.ltx2.default import build_ltx2_components as build_tiny

    c = build_tiny(rope_type="interleaved")
    tiny = c["transformer"].config
    heads, head_dim = LTX2_HEADS, LTX2_HEAD_DIM
    # Audio heads = video heads: the cross-modal attentions use the audio head count on both streams.
    transformer = LTX2VideoTransformer3DModel(
        in_channels=tiny.in_channels, out_channels=tiny.out_channels, num_attention_heads=heads,
        attention_head_dim=head_dim, cross_attention_dim=heads * head_dim, audio_in_channels=tiny.audio_in_channels,
        audio_out_channels=tiny.audio_out_channels, audio_num_attention_heads=heads,
        audio_attention_head_dim=head_dim // 2, audio_cross_attention_dim=heads * head_dim // 2,
        num_layers=LTX2_LAYERS, caption_channels=tiny.caption_channels, rope_type="interleaved")
    init_deterministic(transformer, SEED)
    c["transformer"] = transformer.eval()
    return c

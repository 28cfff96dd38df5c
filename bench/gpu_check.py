"""One prepared device check of the CUDA path at one rank (#42): each family at a real transformer size with random
weights, in the device's default dtype (``cp_infer.devices``: bf16 and TF32 on CUDA), against diffusers' own pipeline
over the same modules, plus the paths diffusers has no one-call peer for. Prints one table.

    python bench/gpu_check.py                        # CUDA: real-size transformers (sized for < 8 min on one H200)
    python bench/gpu_check.py --device cpu --quick   # the CPU smoke mode (tests/test_gpu_check.py runs it)

Rows: the ring's maths on the device (``cp_infer.ring``: each key/value block's attention with its log-sum-exp,
merged in fp32, one block all padding and a key mask) against SDPA over every key at once; LTX-Video, LTX-2, Wan 2.1
and Helios text-to-video against ``LTXPipeline``, ``LTX2Pipeline``, ``WanPipeline``
and ``HeliosPipeline`` (two chunks, so the second reads the first's history); Helios's long videos of 1, 4 and 16
chunks streamed, a medium model (8 of its 40 layers): seconds per chunk, the first chunk's and the last's, and the
peak memory against the one-chunk video's (#40's targets: 1.10x and 1.1x);
LTX-Video image-to-video against ``LTXImageToVideoPipeline`` (conditioning); an LTX-Video long video in windows,
two stages (half size, the latent upsampler, a refine) and ``--offload transformer_blocks,text_encoder,vae`` (against
the same request without offload), ours only. Columns: our median step and diffusers' (each step ends in a device
synchronize; the first step is left out), the final latents' largest difference relative to the reference's largest
value, and the peak ``torch.cuda.max_memory_allocated`` of each run.

The transformers have their checkpoints' layer counts and widths (``FULL``; LTX-2's from ``bench/configs/ltx2``),
built on the device with torch's default init (``--layers`` cuts the layer count); their latent and caption channels,
and every other component, are the embedded tiny models' (their VAEs have the real compression), so the transformer
dominates the time and memory, as on a real checkpoint. ``--weights sharded`` needs a replica group of two ranks or
more, so at one rank its row says so rather than run. Agreement: bf16 rounds every matmul, and ours and diffusers
order some sums differently (the padded attention heads, the guidance combined per pass), so a few percent of the
latents' range is expected in bf16 and 1e-3 in fp32 (``--quick``); the ``ok`` column applies that bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cp_infer.devices import apply_device_defaults, device_defaults  # noqa: E402

PROMPT = "a red fox runs through fresh snow at dawn, cinematic tracking shot"
NEGATIVE = "blurry, low quality"
SEED = 1234
LTX2_CONFIG = Path(__file__).resolve().parent / "configs" / "ltx2" / "transformer" / "config.json"
HELIOS_CONFIG = Path(__file__).resolve().parent / "configs" / "helios" / "transformer" / "config.json"
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.08, torch.float16: 0.08}
"""The largest latent difference, relative to the reference's largest value, that passes (module docstring)."""


@dataclass(frozen=True)
class Sizes:
    ltx: dict[str, int]
    """``LTXVideoTransformer3DModel``'s shape (LTX-Video 0.9's 2B: 28 layers, 32 heads x 64)."""
    ltx2_layers: int | None
    """LTX-2's layer count (``None``: its config's 48, 18.9B)."""
    ltx2_narrow: bool
    """LTX-2 at 2 heads x 16 (audio 2 x 8) instead of its config's widths (the CPU smoke mode)."""
    wan: dict[str, int]
    """``WanTransformer3DModel``'s shape (Wan 2.1 T2V 1.3B: 30 layers, 12 heads x 128, feed-forward 8960)."""
    helios: dict[str, Any]
    """Changes to ``HeliosTransformer3DModel``'s config (``bench/configs/helios``, Helios-Base: 40 x 40 x 128)."""
    frames: int
    height: int
    width: int
    wan_frames: int
    wan_height: int
    wan_width: int
    helios_frames: int
    helios_height: int
    helios_width: int
    helios_chunks: tuple[int, ...]
    """The long videos' chunk counts (Helios's long-video row: seconds per chunk, peak memory, #40's targets)."""
    helios_long_layers: int | None
    """The long-video row's layer count (``None``: the parity row's): a medium Helios, so 16 chunks fit the check."""
    long_frames: int
    tile: int
    overlap: int
    steps: int
    ring: tuple[int, int, int, int] = (32, 64, 6144, 4)
    """The ring row's heads, head size, keys and blocks (a self-attention layer of LTX-Video 2B at 768x512x121)."""


FULL = Sizes(ltx=dict(num_layers=28, num_attention_heads=32, attention_head_dim=64), ltx2_layers=None,
             ltx2_narrow=False, wan=dict(num_layers=30, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960),
             helios={},
             frames=121, height=512, width=768, wan_frames=81, wan_height=480, wan_width=832,
             helios_frames=65, helios_height=384, helios_width=640, helios_chunks=(1, 4, 16), helios_long_layers=8,
             long_frames=249, tile=120, overlap=24, steps=8)
QUICK = Sizes(ltx=dict(num_layers=1, num_attention_heads=2, attention_head_dim=16), ltx2_layers=1,
              ltx2_narrow=True, wan=dict(num_layers=1, num_attention_heads=2, attention_head_dim=16, ffn_dim=64),
              helios=dict(num_layers=1, num_attention_heads=2, attention_head_dim=12, ffn_dim=64, rope_dim=(4, 4, 4)),
              frames=9, height=128, width=192, wan_frames=9, wan_height=64, wan_width=96,
              helios_frames=65, helios_height=64, helios_width=96, helios_chunks=(1, 2), helios_long_layers=None,
              long_frames=65, tile=40, overlap=24, steps=2, ring=(2, 16, 64, 4))


class _Device:
    """Where the check runs: synchronize, the peak memory, the dtype each component takes."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None

    def build(self, make: Any) -> torch.nn.Module:
        """``make()`` built on the device in the dtype (no float32 copy first), its keep-in-fp32 modules in float32
        as ``from_pretrained`` keeps them."""
        torch.manual_seed(SEED)
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                model = make()
        finally:
            torch.set_default_dtype(default)
        keep = getattr(model, "_keep_in_fp32_modules", None) or ()
        for name, param in model.named_parameters():
            if any(k in name.split(".") for k in keep):
                param.data = param.data.float()
        return model.eval()

    def place(self, module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
        dtype = dtype or self.dtype
        return (module.to(self.device) if module.dtype == dtype else module.to(self.device, dtype=dtype)).eval()


class _Steps:
    """Step ends, each after a device synchronize: the median gap between them is one step."""

    def __init__(self, dev: _Device) -> None:
        self.dev, self.ends = dev, []

    def mark(self, *_args: Any) -> dict:
        self.dev.sync()
        self.ends.append(time.perf_counter())
        return {}

    def median(self) -> float | None:
        gaps = np.diff(self.ends)
        return float(statistics.median(gaps)) if len(gaps) else None


def _ours(model: Any, request: Any, dev: _Device) -> dict[str, Any]:
    """``cp_infer.sampler.sample`` at one rank: the final latents as the pipeline returns them, step time, peak."""
    from cp_infer import single_process_state
    from cp_infer.sampler import SampleControl, sample

    steps, out = _Steps(dev), {}
    dev.reset_peak()
    control = SampleControl(on_step=lambda *_: steps.mark(), on_latents=out.update)
    frames = sample(model, request, state=single_process_state(dev.device), control=control)
    return dict(latents=out, step_s=steps.median(), peak_gib=dev.peak_gib(), frames=frames.shape,
                windows=model.plan(request).windows)


def _theirs(pipe: Any, dev: _Device, **kwargs: Any) -> dict[str, Any]:
    steps = _Steps(dev)
    pipe.set_progress_bar_config(disable=True)
    dev.reset_peak()
    with torch.inference_mode():
        out = pipe(generator=torch.Generator("cpu").manual_seed(SEED), output_type="latent",
                   callback_on_step_end=lambda *a: steps.mark(), **kwargs)
    latents = {"latents": out.frames}
    if getattr(out, "audio", None) is not None:
        latents["audio_latents"] = out.audio
    return dict(latents=latents, step_s=steps.median(), peak_gib=dev.peak_gib())


def _difference(ours: dict[str, Any], reference: dict[str, Any]) -> float:
    """The largest latent difference over every stream, relative to the reference's largest value."""
    worst = 0.0
    for name, ref in reference.items():
        a = torch.as_tensor(np.asarray(ours[name]), dtype=torch.float32)
        b = torch.as_tensor(ref.float().cpu().numpy() if torch.is_tensor(ref) else np.asarray(ref),
                            dtype=torch.float32)
        if a.shape != b.shape:
            raise AssertionError(f"{name}: ours {tuple(a.shape)}, the reference {tuple(b.shape)}")
        worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)))
    return worst


def _request(model: Any, **values: Any) -> Any:
    from cp_infer.request import GenerationRequest, resolve_request

    return resolve_request(GenerationRequest.of(prompt=PROMPT, negative_prompt=NEGATIVE, seed=SEED, **values),
                           model.options)


# ------------------------------------------------------------------------------------------------- the families


def _ltx_video_rows(sizes: Sizes, dev: _Device) -> list[dict[str, Any]]:
    from diffusers import LTXImageToVideoPipeline, LTXPipeline, LTXVideoTransformer3DModel
    from PIL import Image

    from cp_infer.request import Condition
    from models.common.placement import Placement, apply_offload
    from models.ltx_video.adapter import LTXVideoModel
    from models.ltx_video.default import build_default_components, build_latent_upsampler
    from models.ltx_video.loading import LTXVideoComponents

    tiny = build_default_components()
    transformer = dev.build(lambda: LTXVideoTransformer3DModel(
        in_channels=16, out_channels=16, patch_size=1, patch_size_t=1,
        caption_channels=tiny["text_encoder"].config.d_model,
        cross_attention_dim=sizes.ltx["num_attention_heads"] * sizes.ltx["attention_head_dim"], **sizes.ltx))
    parts = dict(transformer=transformer, vae=dev.place(tiny["vae"]), text_encoder=dev.place(tiny["text_encoder"]),
                 scheduler=tiny["scheduler"], tokenizer=tiny["tokenizer"])
    label = _label("LTX-Video", transformer)
    t2v = dict(num_frames=sizes.frames, height=sizes.height, width=sizes.width, num_inference_steps=sizes.steps,
               guidance_scale=3.0)
    image = np.random.default_rng(SEED).integers(0, 256, (1, sizes.height, sizes.width, 3), dtype=np.uint8)
    common = dict(prompt=PROMPT, negative_prompt=NEGATIVE, frame_rate=24, max_sequence_length=128, **t2v)
    # diffusers first: our adapter installs its attention processors on the same transformer.
    theirs = _theirs(LTXPipeline(**parts), dev, **common)
    theirs_i2v = _theirs(LTXImageToVideoPipeline(**parts), dev, image=Image.fromarray(image[0]), **common)
    components = LTXVideoComponents(**parts, path=Path(tempfile.mkdtemp()), dtype=dev.dtype, device=dev.device,
                                    latent_upsampler=dev.place(build_latent_upsampler()))
    model = LTXVideoModel(components, state=_state(dev))
    one_window = dict(t2v, temporal_tile_size=max(sizes.tile, sizes.frames + 7), fps=24, max_sequence_length=128,
                      stages=1)
    rows = []
    ours = _ours(model, _request(model, **one_window), dev)
    rows.append(_row(f"{label}: text-to-video", ours, theirs, "LTXPipeline"))
    i2v = _ours(model, _request(model, **one_window, image=Condition(image)), dev)
    rows.append(_row(f"{label}: image-to-video", i2v, theirs_i2v, "LTXImageToVideoPipeline"))
    long = _ours(model, _request(model, **dict(one_window, num_frames=sizes.long_frames, temporal_tile_size=sizes.tile,
                                                temporal_overlap=sizes.overlap)), dev)
    rows.append(_row(f"{label}: {sizes.long_frames} frames in {long['windows']} windows", long, None, "-"))
    two = _ours(model, _request(model, **dict(one_window, stages=2)), dev)
    rows.append(_row(f"{label}: two stages (half size, upsampler, refine)", two, None, "-"))
    rows.append(dict(case=f"{label}: --weights sharded", reference="-", note="needs a replica group of >= 2 ranks: "
                     "a group of one loads replicated (models.common.placement)"))
    # Offloaded components start on the CPU (models.common.placement).
    for name in ("transformer", "text_encoder", "vae"):
        getattr(components, name).to("cpu")
    apply_offload(components, Placement(weights="replicated", offload=("transformer_blocks", "text_encoder", "vae"),
                                        state=_state(dev)))
    offloaded = _ours(model, _request(model, **one_window), dev)
    rows.append(_row(f"{label}: --offload transformer_blocks,text_encoder,vae", offloaded,
                     dict(latents={k: torch.as_tensor(v) for k, v in ours["latents"].items()}), "ours without offload"))
    return rows


def _ltx2_rows(sizes: Sizes, dev: _Device) -> list[dict[str, Any]]:
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

    from models.ltx2.adapter import LTX2Model
    from models.ltx2.default import build_ltx2_components

    tiny = build_ltx2_components(rope_type="interleaved")
    small = tiny["transformer"].config
    config = {k: v for k, v in json.loads(LTX2_CONFIG.read_text()).items() if not k.startswith("_")}
    config.update({k: small[k] for k in ("in_channels", "out_channels", "audio_in_channels", "audio_out_channels",
                                         "caption_channels")})
    config["vae_scale_factors"] = tuple(config["vae_scale_factors"])
    if sizes.ltx2_layers is not None:
        config["num_layers"] = sizes.ltx2_layers
    if sizes.ltx2_narrow:
        config.update(num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32, audio_num_attention_heads=2,
                      audio_attention_head_dim=8, audio_cross_attention_dim=16)
    transformer = dev.build(lambda: LTX2VideoTransformer3DModel(**config))
    parts = {**{k: (dev.place(v, torch.float32 if k == "vocoder" else None) if isinstance(v, torch.nn.Module) else v)
                for k, v in tiny.items() if k != "transformer"}, "transformer": transformer}
    label = _label("LTX-2", transformer)
    guidance = dict(guidance_scale=3.0, audio_guidance_scale=7.0, stg_scale=1.0, audio_stg_scale=1.0,
                    modality_scale=3.0, audio_modality_scale=3.0, guidance_rescale=0.7, audio_guidance_rescale=0.7)
    stg = (config["num_layers"] - 1,)
    values = dict(num_frames=sizes.frames, height=sizes.height, width=sizes.width, num_inference_steps=sizes.steps)
    theirs = _theirs(LTX2Pipeline(**parts), dev, prompt=PROMPT, negative_prompt=NEGATIVE, frame_rate=24,
                     spatio_temporal_guidance_blocks=list(stg), max_sequence_length=128, **values, **guidance)
    model = LTX2Model(SimpleNamespace(**parts), state=_state(dev))
    ours = _ours(model, _request(model, **values, fps=24, spatio_temporal_guidance_blocks=stg, max_sequence_length=128,
                                 stages=1, **guidance), dev)
    return [_row(f"{label}: text-to-video, audio", ours, theirs, "LTX2Pipeline")]


def _wan_rows(sizes: Sizes, dev: _Device) -> list[dict[str, Any]]:
    from diffusers import WanPipeline, WanTransformer3DModel

    from models.wan.adapter import WanModel
    from models.wan.default import build_wan_pipeline
    from models.wan.loading import WanComponents

    tiny = build_wan_pipeline("t2v")
    transformer = dev.build(lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), in_channels=tiny.vae.config.z_dim, out_channels=tiny.vae.config.z_dim,
        text_dim=tiny.text_encoder.config.d_model, freq_dim=256, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **sizes.wan))
    # Wan's VAE in float32, as models.wan.loading and diffusers' Wan examples keep it.
    components = WanComponents(transformer=transformer, vae=dev.place(tiny.vae, torch.float32),
                               scheduler=tiny.scheduler, text_encoder=dev.place(tiny.text_encoder),
                               tokenizer=tiny.tokenizer, path=Path("."), dtype=dev.dtype, device=dev.device)
    label = _label("Wan 2.1", transformer)
    values = dict(num_frames=sizes.wan_frames, height=sizes.wan_height, width=sizes.wan_width,
                  num_inference_steps=sizes.steps, guidance_scale=5.0)
    theirs = _theirs(WanPipeline(transformer=transformer, vae=components.vae, text_encoder=components.text_encoder,
                                 tokenizer=tiny.tokenizer, scheduler=tiny.scheduler), dev, prompt=PROMPT,
                     negative_prompt=NEGATIVE, max_sequence_length=128, **values)
    model = WanModel(components, state=_state(dev))
    ours = _ours(model, _request(model, **values, max_sequence_length=128), dev)
    return [_row(f"{label}: text-to-video", ours, theirs, "WanPipeline")]


def _helios_rows(sizes: Sizes, dev: _Device) -> list[dict[str, Any]]:
    from diffusers import HeliosPipeline, HeliosTransformer3DModel

    from models.helios.adapter import HeliosModel
    from models.helios.default import build_helios_pipeline
    from models.helios.loading import HeliosComponents

    tiny = build_helios_pipeline()
    config = {k: v for k, v in json.loads(HELIOS_CONFIG.read_text()).items() if not k.startswith("_")}
    config.update(in_channels=tiny.vae.config.z_dim, out_channels=tiny.vae.config.z_dim,
                  text_dim=tiny.text_encoder.config.d_model, **sizes.helios)
    transformer = dev.build(lambda: HeliosTransformer3DModel(**config))
    # Helios's VAE in float32, as models.helios.loading and HeliosPipeline's example keep it.
    components = HeliosComponents(transformer=transformer, vae=dev.place(tiny.vae, torch.float32),
                                  scheduler=tiny.scheduler, text_encoder=dev.place(tiny.text_encoder),
                                  tokenizer=tiny.tokenizer, path=Path("."), dtype=dev.dtype, device=dev.device)
    label = _label("Helios", transformer)
    values = dict(num_frames=sizes.helios_frames, height=sizes.helios_height, width=sizes.helios_width,
                  num_inference_steps=sizes.steps, guidance_scale=5.0)
    theirs = _theirs(HeliosPipeline(transformer=transformer, vae=components.vae, text_encoder=components.text_encoder,
                                    tokenizer=tiny.tokenizer, scheduler=tiny.scheduler), dev, prompt=PROMPT,
                     negative_prompt=NEGATIVE, **values)
    model = HeliosModel(components, state=_state(dev))
    ours = _ours(model, _request(model, **values), dev)
    rows = [_row(f"{label}: text-to-video, {sizes.helios_frames} frames in 2 chunks", ours, theirs, "HeliosPipeline")]
    if sizes.helios_long_layers is not None:
        # The parity row's transformer goes before the medium one is built (the peaks are the long videos' own).
        del model, ours, theirs, transformer
        components = replace(components, transformer=None)
        gc.collect()
        dev.reset_peak()
        config["num_layers"] = sizes.helios_long_layers
        transformer = dev.build(lambda: HeliosTransformer3DModel(**config))
        model = HeliosModel(replace(components, transformer=transformer), state=_state(dev))
        label = _label("Helios", transformer)
    return rows + _helios_long_rows(model, label, values, sizes, dev)


def _helios_long_rows(model: Any, label: str, values: dict[str, Any], sizes: Sizes,
                      dev: _Device) -> list[dict[str, Any]]:
    """Helios's long videos as the server makes them (streamed: ``collect=False``, frames dropped as they come):
    seconds per chunk from one chunk's start to the next's (its steps, history update and streamed decode), the
    first chunk's and the last's, and the peak memory, against the one-chunk video's (#40: within 1.10x and 1.1x)."""
    from cp_infer.sampler import SampleControl, sample

    runs = {}
    for chunks in sizes.helios_chunks:
        marks: list[float] = []

        def mark(*_args: Any, marks: list[float] = marks) -> None:
            dev.sync()
            marks.append(time.perf_counter())

        dev.reset_peak()
        request = _request(model, **dict(values, num_frames=_helios_frames(chunks)))
        sample(model, request, state=_state(dev), control=SampleControl(on_pass=mark, collect=False))
        mark()
        runs[chunks] = dict(seconds=np.diff(marks).tolist(), peak_gib=dev.peak_gib())
    first = runs[sizes.helios_chunks[0]]
    rows = []
    for chunks, run in runs.items():
        seconds = run["seconds"]
        note = f"chunk 1 {seconds[0]:.2f} s, chunk {chunks} {seconds[-1]:.2f} s ({seconds[-1] / seconds[0]:.2f}x)"
        if run["peak_gib"] is not None and chunks != sizes.helios_chunks[0]:
            note += f"; peak {run['peak_gib'] / first['peak_gib']:.2f}x the first video's"
        case = f"{label}: {_helios_frames(chunks)} frames in {chunks} chunk{'s' * (chunks > 1)}, streamed"
        rows.append(dict(case=case, reference="-", ours_peak_gib=run["peak_gib"], note=note))
    return rows


def _helios_frames(chunks: int) -> int:
    """The frames of ``chunks`` whole Helios chunks (33 frames each, the video cut to 4k + 1 frames)."""
    return 33 * chunks - (33 * chunks - 1) % 4


def _ring_rows(sizes: Sizes, dev: _Device) -> list[dict[str, Any]]:
    """The ring's maths at one rank (no point-to-point step, which needs two): the blocks as a ring of ``blocks``
    ranks holds them, the last all padding and the one before partly; each real block's ``attention_lse`` merged by
    ``BlockMerge``, against one ``scaled_dot_product_attention`` over the real keys. Two rows: batch row 1 masking
    its first keys (on CUDA: fp32 matmuls), and no mask (on CUDA: the fused kernel, where ``fused_lse_ok`` takes it).
    Step: the median of 5 calls of each."""
    return [_ring_row(sizes, dev, masked=True), _ring_row(sizes, dev, masked=False)]


def _ring_row(sizes: Sizes, dev: _Device, *, masked: bool) -> dict[str, Any]:
    import torch.nn.functional as F

    from cp_infer.ring import BlockMerge, attention_lse, fused_lse_ok

    heads, dim, keys, blocks = sizes.ring
    block = keys // blocks
    real = keys - block - 3  # the last block all padding, the one before with 3 padded keys
    g = torch.Generator("cpu").manual_seed(SEED)
    q, k, v = (torch.randn(2, heads, keys, dim, generator=g).to(dev.device, dev.dtype) for _ in range(3))
    mask = torch.ones(2, real, dtype=torch.bool, device=dev.device)
    if masked:
        mask[1, :5] = False

    def ring() -> torch.Tensor:
        merge = BlockMerge(q)
        for j in range(blocks):
            start = j * block
            n = min(block, real - start)
            if n > 0:
                merge.add(*attention_lse(q, k[:, :, start:start + n], v[:, :, start:start + n],
                                         key_mask=mask[:, start:start + n] if masked else None))
        return merge.result()

    def whole() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k[:, :, :real], v[:, :, :real],
                                              attn_mask=mask[:, None, None, :] if masked else None)

    timed = {}
    for name, call in (("ours", ring), ("theirs", whole)):
        dev.reset_peak()
        times = []
        with torch.inference_mode():
            for _ in range(6):
                dev.sync()
                started = time.perf_counter()
                out = call()
                dev.sync()
                times.append(time.perf_counter() - started)
        timed[name] = dict(out=out.float().cpu(), step_s=statistics.median(times[1:]), peak_gib=dev.peak_gib())
    ours, theirs = timed["ours"], timed["theirs"]
    difference = float((ours["out"] - theirs["out"]).abs().max() / theirs["out"].abs().max().clamp_min(1e-12))
    if masked:
        path = "a key mask" + (": fp32 matmuls" if dev.device.type == "cuda" else "")
    elif dev.device.type == "cuda":
        path = "no mask: " + ("the fused kernel" if fused_lse_ok(dev.device, dev.dtype, dim) else
                              "fp32 matmuls (no fused kernel passed its check)")
    else:
        path = "no mask"
    return dict(case=f"ring: {blocks} blocks of {heads} x {dim} over {keys} keys, one all padding, {path}",
                reference="SDPA over every key", ours_step_s=ours["step_s"], theirs_step_s=theirs["step_s"],
                ours_peak_gib=ours["peak_gib"], theirs_peak_gib=theirs["peak_gib"], difference=difference)


def _failed(family: str, error: BaseException) -> dict[str, Any]:
    """A family whose rows raised: one row that says so (its traceback went to stderr), so the others still run."""
    message = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    return dict(case=f"{family}: FAILED", reference="-", note=message, failed=True)


def _state(dev: _Device) -> Any:
    from cp_infer import single_process_state

    return single_process_state(dev.device)


def _label(family: str, transformer: torch.nn.Module) -> str:
    config = transformer.config
    params = sum(p.numel() for p in transformer.parameters())
    return (f"{family} {config.num_layers} x {config.num_attention_heads} x {config.attention_head_dim} "
            f"({params / 1e9:.2f}B)")


def _row(case: str, ours: dict[str, Any], theirs: dict[str, Any] | None, reference: str) -> dict[str, Any]:
    row = dict(case=case, reference=reference, ours_step_s=ours["step_s"], ours_peak_gib=ours["peak_gib"])
    if theirs is not None:
        row.update(difference=_difference(ours["latents"], theirs["latents"]), theirs_step_s=theirs.get("step_s"),
                   theirs_peak_gib=theirs.get("peak_gib"))
    return row


# ----------------------------------------------------------------------------------------------------- the table


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]], *, dtype: torch.dtype) -> list[str]:
    tolerance = TOLERANCE[dtype]
    lines = ["| case | reference | ours step (s) | reference step (s) | max rel. latent diff | ok | ours peak (GiB) "
             "| reference peak (GiB) |", "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        diff = r.get("difference")
        ok = "NO" if r.get("failed") else "-" if diff is None else ("yes" if diff <= tolerance else "NO")
        lines.append(f"| {r['case']} | {r['reference']} | {_cell(r.get('ours_step_s'), '.3f')} | "
                     f"{_cell(r.get('theirs_step_s'), '.3f')} | {_cell(diff, '.2e')} | {ok} | "
                     f"{_cell(r.get('ours_peak_gib'), '.2f')} | {_cell(r.get('theirs_peak_gib'), '.2f')} |"
                     + (f" {r['note']}" if r.get("note") else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="tiny transformers and videos (the CPU smoke mode)")
    ap.add_argument("--layers", type=int, default=None, help="cut every transformer to this many layers")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                    help="the transformer's and text encoder's dtype (default: the device's, cp_infer.devices)")
    ap.add_argument("--families", default="ring,ltx-video,wan,helios,ltx2", help="comma-separated subset, in order")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here; use --device cpu --quick")
    sizes = QUICK if args.quick else FULL
    if args.layers is not None:
        cut = {"num_layers": args.layers}
        sizes = replace(sizes, ltx={**sizes.ltx, **cut}, ltx2_layers=args.layers, wan={**sizes.wan, **cut},
                        helios={**sizes.helios, **cut})
    defaults = apply_device_defaults(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or device_defaults(args.device).dtype]
    dev = _Device(args.device, dtype)
    started, rows = time.perf_counter(), []
    builders = {"ring": _ring_rows, "ltx-video": _ltx_video_rows, "ltx2": _ltx2_rows, "wan": _wan_rows,
                "helios": _helios_rows}
    for family in args.families.split(","):
        began = time.perf_counter()
        try:
            made = builders[family](sizes, dev)
        except Exception as error:  # noqa: BLE001 - one family's failure is a row; the others still run
            traceback.print_exc()
            made = [_failed(family, error)]
        rows.extend(made)
        if dev.cuda:
            torch.cuda.empty_cache()
        print(f"[gpu_check] {family}: {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
        print("\n".join(table(made, dtype=dtype)[2:]), file=sys.stderr, flush=True)
    name = torch.cuda.get_device_name(dev.device) if dev.cuda else "cpu"
    print(f"bench/gpu_check.py {' '.join(argv if argv is not None else sys.argv[1:])}: {name}, 1 rank, "
          f"{str(dtype).removeprefix('torch.')}, TF32 {'on' if defaults.tf32 else 'off'}, torch {torch.__version__}; "
          f"{sizes.steps} steps; {time.perf_counter() - started:.0f} s in all")
    print("\n".join(table(rows, dtype=dtype)))
    failed = [r["case"] for r in rows
              if r.get("failed") or (r.get("difference") is not None and r["difference"] > TOLERANCE[dtype])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Long videos as temporal windows, as diffusers' ``LTXI2VLongMultiPromptPipeline`` cuts them: the options, the
windows, the prompt of each window and the plan. Pure arithmetic on the request: imports no model code, so the
options modules that use it stay cheap for front ends.

Invariants:
- A request whose latent frames fit one window (``temporal_tile_size``) is not windowed: it runs as it always has.
  A longer two-stage request (``stages=2``) runs stage 1 window by window at half the size, then stage 2 over the
  windows at full size (:func:`two_stage_window_plan`).
  A longer one runs as windows of ``temporal_tile_size // 8`` latent frames that start ``tile - overlap`` apart
  (the pipeline's ``split_into_temporal_windows``); each window is one pass of the plan, conditioned on the tail of
  the latents made so far.
- Each window after the first adds ``end - start - overlap`` latent frames (its first dropped, ``overlap - 1``
  blended with the frames before), so the windows together make exactly the request's latent frames: the overlap is
  at least 3 latent frames (24 video frames; with fewer the pipeline blends nothing and makes a longer video than
  asked for) and smaller than the tile.
- After window ``w`` every latent frame but the last ``overlap - 1`` (blended with the next window) is final.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from cp_infer.options import Option
from cp_infer.plan import DenoisePass, Plan
from cp_infer.request import GenerationRequest

__all__ = ["TEMPORAL_COMPRESSION", "Windows", "check_windows", "live_frames", "prompt_segments_option",
           "two_stage_window_plan", "window_count", "window_frames", "window_options", "window_plan", "window_starts",
           "windows_of"]

TEMPORAL_COMPRESSION = 8
"""Video frames per latent frame of the LTX VAEs (the first latent frame holds one)."""
MIN_OVERLAP = 3
"""Latent frames of the smallest overlap (see the invariants)."""


def window_options(*, default_tile: int, default_overlap: int, image: bool = True) -> tuple[Option, ...]:
    """The window options, named and defaulted as ``LTXI2VLongMultiPromptPipeline``'s (80 and 24 frames); ``image``:
    whether windows take an image (``cond_strength``)."""
    options = (
        Option("temporal_tile_size", int, default_tile, "frames per window: a longer video is made window by "
               "window, each conditioned on the one before", lo=(MIN_OVERLAP + 1) * TEMPORAL_COMPRESSION,
               hi=100_000),
        Option("temporal_overlap", int, default_overlap, "frames each window shares with the one before (fewer "
               "than temporal_tile_size)", lo=MIN_OVERLAP * TEMPORAL_COMPRESSION, hi=100_000),
        Option("temporal_overlap_cond_strength", float, 0.5, "how strongly the previous window's tail conditions "
               "the next window", lo=0, hi=1),
        Option("cond_strength", float, 0.5, "with an image and a video longer than one window: how strongly the "
               "image holds the first frame (the image also conditions every window as a negative-index frame, until "
               "a window given its own image in conditions; 0: no image is used)", lo=0, hi=1),
        prompt_segments_option(),
    )
    return options if image else tuple(o for o in options if o.name != "cond_strength")


def prompt_segments_option() -> Option:
    """``prompt_segments``: a prompt per range of windows (:func:`window_prompts` reads it)."""
    return Option("prompt_segments", list, None, "a prompt per range of windows: [{\"start_window\": 0, "
                  "\"end_window\": 1, \"text\": \"...\"}, ...] (unset: the prompt, split at '|', one part per "
                  "window, the last one repeated)", nullable=True, max_items=64, check=_check_segments)


def _check_segments(segments: Sequence[Any]) -> None:
    for i, seg in enumerate(segments):
        where = f"prompt_segments[{i}]"
        if not isinstance(seg, Mapping) or set(seg) - {"start_window", "end_window", "text"} or "text" not in seg:
            raise ValueError(f"{where} must be an object with text and optional start_window, end_window, e.g. "
                             "{\"start_window\": 0, \"end_window\": 1, \"text\": \"a fox runs\"}")
        start, end = seg.get("start_window", 0), seg.get("end_window", seg.get("start_window", 0))
        for name, value in (("start_window", start), ("end_window", end)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10_000:
                raise ValueError(f"{where}.{name}={value!r} must be a window index in [0, 10000]")
        if end < start:
            raise ValueError(f"{where}: end_window={end} is before start_window={start}; swap them")
        if not isinstance(seg["text"], str) or not seg["text"].strip():
            raise ValueError(f"{where}.text must be a non-empty string (the prompt of those windows)")


class Windows:
    """The windows of one request, in latent frames."""

    def __init__(self, latent_frames: int, tile: int, overlap: int):
        self.latent_frames, self.tile, self.overlap = latent_frames, tile, overlap
        stride = max(tile - overlap, 1)
        spans, start = [], 0
        while True:
            end = min(start + tile, latent_frames)
            spans.append((start, end))
            if end == latent_frames:
                break
            start += stride
        self.spans: tuple[tuple[int, int], ...] = tuple(spans)

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def blend(self) -> int:
        """Latent frames of the video made so far that the next window is blended into."""
        return self.overlap - 1

    def made(self, window: int) -> int:
        """Latent frames of the video made once window ``window`` is done."""
        return self.spans[window][1]

    def final(self, window: int) -> int:
        """Latent frames that are final once window ``window`` is done (the next blends into the rest)."""
        return self.latent_frames if window == len(self) - 1 else self.made(window) - self.blend


def windows_of(request: GenerationRequest | Mapping[str, Any]) -> Windows | None:
    """The windows of a resolved request (or its option values), ``None`` when it fits one window.

    An extension (``GenerationRequest.extends``) is always windows: the latent frames of the tail it continues
    (``overlap`` of them, the video made before its first window) and its ``num_frames - 1`` new frames'."""
    values = request if isinstance(request, Mapping) else {"num_frames": request.num_frames, **request.options}
    tile = max(1, values["temporal_tile_size"] // TEMPORAL_COMPRESSION)
    overlap = values["temporal_overlap"] // TEMPORAL_COMPRESSION
    if not isinstance(request, Mapping) and request.extends is not None:
        return Windows(overlap + (request.num_frames - 1) // TEMPORAL_COMPRESSION, tile, overlap)
    latent = (values["num_frames"] - 1) // TEMPORAL_COMPRESSION + 1
    if latent <= tile:
        return None
    return Windows(latent, tile, overlap)


def check_windows(values: Mapping[str, Any]) -> None:
    """The window options against each other (a ``ModelOptions.check`` part)."""
    tile, overlap = values["temporal_tile_size"], values["temporal_overlap"]
    if overlap // TEMPORAL_COMPRESSION >= tile // TEMPORAL_COMPRESSION:
        raise ValueError(f"temporal_overlap={overlap} is not smaller than temporal_tile_size={tile} (in latent frames "
                         f"of {TEMPORAL_COMPRESSION}): use a smaller overlap or a larger tile")
    if values.get("prompt_segments") and windows_of(values) is None:
        raise ValueError("prompt_segments: the video fits one window (num_frames <= temporal_tile_size); give one "
                         "prompt, or ask for more frames")


def window_count(values: Mapping[str, Any]) -> int:
    """The windows a request's video is made in (``ModelOptions.window_count``): 1 when it fits one window."""
    windows = windows_of(values)
    return 1 if windows is None else len(windows)


def window_starts(values: Mapping[str, Any]) -> tuple[int, ...]:
    """The video frame each window starts from (``ModelOptions.window_images``: where a request's ``conditions``
    give a window its image): the first frame of its first latent frame."""
    windows = windows_of(values)
    spans = ((0, 0),) if windows is None else windows.spans
    return tuple(0 if start == 0 else (start - 1) * TEMPORAL_COMPRESSION + 1 for start, _ in spans)


def window_frames(values: Mapping[str, Any]) -> int:
    """Video frames of the longest pass's sequence: the whole video, or a window with the previous tail it is
    conditioned on (the deployment's token limit applies to it)."""
    windows = windows_of(values)
    if windows is None:
        return values["num_frames"]
    latent = max(end - start for start, end in windows.spans) + windows.overlap
    return (latent - 1) * TEMPORAL_COMPRESSION + 1


def live_frames(values: Mapping[str, Any], count: int) -> int:
    """Video frames of ``count`` whole windows (``ModelOptions.live_frames``): each window a whole tile, so a window's
    pass and draws (``seed + start``) do not depend on how many follow it. A video of one window is not made in
    windows, so a live one starts with two; two stages refine the whole video after its first stage, so a live one
    has one."""
    if values.get("stages", 1) != 1:
        raise ValueError(f"stages={values['stages']}: a live video is made in one stage (stage 2 refines the whole "
                         "video once stage 1 is made); give stages=1")
    tile = max(1, values["temporal_tile_size"] // TEMPORAL_COMPRESSION)
    stride = tile - values["temporal_overlap"] // TEMPORAL_COMPRESSION
    if count < 2:
        two = (tile + stride - 1) * TEMPORAL_COMPRESSION + 1
        raise ValueError(f"a live video starts with 2 windows or more: num_frames={two} or more at this "
                         "temporal_tile_size and temporal_overlap")
    return (tile + (count - 1) * stride - 1) * TEMPORAL_COMPRESSION + 1


def window_prompts(request: GenerationRequest, windows: Windows) -> list[str]:
    """The prompt of each window: ``prompt_segments`` (each window its segment's text, gaps taking the one before),
    or the prompt split at ``|``; windows past the last prompt take the last (``parse_prompt_segments``)."""
    segments = request.options.get("prompt_segments")
    if segments:
        texts = [""] * (max(int(s.get("end_window", s.get("start_window", 0))) for s in segments) + 1)
        for seg in segments:
            start = int(seg.get("start_window", 0))
            for w in range(start, int(seg.get("end_window", start)) + 1):
                texts[w] = seg["text"]
        last = ""
        for i, text in enumerate(texts):
            texts[i] = last = text or last
    else:
        texts = [part.strip() for part in request.prompt.split("|")]
    return [texts[min(w, len(texts) - 1)] or request.prompt for w in range(len(windows))]


def two_stage_window_plan(request: GenerationRequest, windows: Windows, *, steps: int, refine_steps: int,
                          refine_options: Mapping[str, Any] | None = None, **refine_fields: Any) -> Plan:
    """Two stages over the windows: every window at half the size (``stage1_window`` passes of ``steps``), then every
    window again at full size (``refine_window`` passes of ``refine_steps``, their request changed by
    ``refine_fields`` and ``refine_options``), the second from the first's latents upsampled as a whole. Stage 2
    goes over the windows (rather than each window two-staged) because the upsampler and the refine then see the
    fused video: one upsample of the whole, and each refine window is conditioned on the refined tail before it, so
    the seams are refined too."""
    one_stage = {**request.options, "stages": 1}
    first = replace(request, height=request.height // 2, width=request.width // 2, options=one_stage)
    second = replace(request, **refine_fields, options={**one_stage, **(refine_options or {})})
    prompts = window_prompts(request, windows)
    return Plan(tuple(DenoisePass(replace(first, prompt=prompts[w]), steps=steps, kind="stage1_window", window=w)
                      for w in range(len(windows)))
                + tuple(DenoisePass(replace(second, prompt=prompts[w]), steps=refine_steps, kind="refine_window",
                                    window=w) for w in range(len(windows))))


def window_plan(request: GenerationRequest, windows: Windows, *, steps: int) -> Plan:
    """One ``window`` pass per window, each with its own prompt and ``steps`` steps."""
    prompts = window_prompts(request, windows)
    return Plan(tuple(DenoisePass(replace(request, prompt=prompts[w]), steps=steps, kind="window", window=w)
                      for w in range(len(windows))))

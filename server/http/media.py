"""Decoding and checking of user-supplied conditioning media (images and video clips), on the front end.

This runs on the HTTP / CLI side, before anything reaches a GPU rank; the ranks only ever see a :class:`Media`.

Invariants:
- Nothing is decoded past the limits. The byte count is checked before any parsing (and a data URL's encoded length
  before its base64 is decoded); a frame's width * height is read from the image header or the video stream's
  codec parameters and checked against ``MediaLimits.max_pixels`` before any pixel is decoded; a video is decoded
  one frame at a time and decoding stops at the first frame past the frame limit.
- The container is chosen by its magic bytes and the decoder is told which one it is (``formats=[...]`` for PIL,
  ``format=`` for FFmpeg), so no other demuxer or image plugin ever looks at the bytes: in particular none that
  follows references to other files or URLs (FFmpeg's playlist demuxers). The server fetches nothing.
- Only :class:`MediaError` leaves :func:`decode_media` and :func:`media_from_url` for bad input: every failure of
  the third-party decoders on user bytes becomes one, naming the request field and what to do about it.
- What comes out is a :class:`Media` whose ``frames`` is a validated, C-contiguous ``uint8 [F, H, W, 3]`` RGB
  array: alpha is dropped, greyscale and palette images are expanded, 16-bit samples are reduced to 8 bits.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

import numpy as np

__all__ = ["Media", "MediaError", "MediaLimits", "decode_media", "media_from_url"]

_KINDS = ("image", "video")
_SUPPORTED = "PNG, JPEG, WebP, GIF, BMP images or MP4, MOV, WebM, MKV, AVI videos"
# ISO-BMFF major brands of still images (HEIF/AVIF): FFmpeg's mov demuxer would read them as a one-frame video.
_STILL_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis"})
# Top-level QuickTime atoms that may open a .mov written without an ``ftyp`` box (what FFmpeg's mov probe accepts).
_QT_ATOMS = frozenset({b"ftyp", b"moov", b"mdat", b"wide"})


class MediaError(ValueError):
    """Bad media in a request: the message says what is wrong with it and what to do instead.

    ``field`` is the request field it came from (``"input_reference"``, ``"conditions[1].media"``), ``code`` a short
    snake_case reason for clients to switch on, ``status`` the HTTP status to answer with (413 when the upload has
    too many bytes, 400 otherwise). ``str(err)`` is ``"<field>: <message>"``; ``message`` is the part after it.
    """

    def __init__(self, field: str, message: str, *, code: str = "invalid_media", status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.code = code
        self.status = status


@dataclass(frozen=True)
class MediaLimits:
    """What the front end agrees to decode from one upload."""

    max_bytes: int = 64 * 2**20
    """Size of one upload in bytes (after base64 decoding, for a data URL)."""
    max_pixels: int = 4096 * 4096
    """Width * height of one frame, read from the header and checked before decoding (decompression bombs)."""
    max_frames: int = 257
    """Frames decoded from one video at most, unless the caller passes its own bound."""

    def __post_init__(self):
        for name in ("max_bytes", "max_pixels", "max_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MediaLimits.{name}={value!r} must be an integer >= 1")


@dataclass(frozen=True)
class Media:
    """Decoded conditioning media: one image or the frames of one clip."""

    frames: np.ndarray
    """uint8 [F, H, W, 3] RGB, C-contiguous."""
    kind: str
    """``"image"`` (then F == 1) or ``"video"``."""

    def __post_init__(self):
        f = self.frames
        if not isinstance(f, np.ndarray) or f.dtype != np.uint8 or f.ndim != 4 or f.shape[-1] != 3:
            got = f"{f.dtype} {list(f.shape)}" if isinstance(f, np.ndarray) else type(f).__name__
            raise ValueError(f"Media.frames must be a uint8 [F, H, W, 3] RGB array, got {got}")
        if min(f.shape[:3]) < 1:
            raise ValueError(f"Media.frames has an empty dimension: {list(f.shape)}")
        if not f.flags.c_contiguous:
            raise ValueError("Media.frames must be C-contiguous; pass np.ascontiguousarray(frames)")
        if self.kind not in _KINDS:
            raise ValueError(f"Media.kind={self.kind!r} must be one of {_KINDS}")
        if self.kind == "image" and f.shape[0] != 1:
            raise ValueError(f"an image has one frame, got {f.shape[0]}; use kind='video'")

    @property
    def num_frames(self) -> int:
        return self.frames.shape[0]

    @property
    def height(self) -> int:
        return self.frames.shape[1]

    @property
    def width(self) -> int:
        return self.frames.shape[2]


def decode_media(
    data: bytes, *, field: str, limits: MediaLimits = MediaLimits(), max_frames: int | None = None
) -> Media:
    """Decode an uploaded image or video clip into RGB frames, or raise :class:`MediaError` naming ``field``.

    ``max_frames`` (the number of frames the request asks for) replaces ``limits.max_frames`` when given: a clip
    with more frames is refused rather than cut, so that the caller never conditions on part of a clip silently.
    """
    if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1):
        raise ValueError(f"max_frames={max_frames!r} must be an integer >= 1 or None")
    if not data:
        raise MediaError(field, f"is empty; send a non-empty file ({_SUPPORTED})")
    if len(data) > limits.max_bytes:
        raise MediaError(
            field,
            f"is {len(data)} bytes, over the limit of {limits.max_bytes} bytes; send a smaller or shorter file",
            code="media_too_large", status=413,
        )
    sniffed = _sniff(data)
    if sniffed is None:
        raise MediaError(field, f"is not an image or video; send one of: {_SUPPORTED}")
    kind, fmt = sniffed
    if kind == "unsupported":
        raise MediaError(field, f"is a {fmt} image, which is not supported; convert it to PNG or JPEG")
    if kind == "image":
        return Media(frames=_decode_image(data, fmt, field=field, limits=limits), kind="image")
    bound = limits.max_frames if max_frames is None else max_frames
    frames = _decode_video(data, fmt, field=field, limits=limits, max_frames=bound, from_request=max_frames is not None)
    return Media(frames=frames, kind="video")


def media_from_url(
    url: str, *, field: str, limits: MediaLimits = MediaLimits(), max_frames: int | None = None
) -> Media:
    """Decode media sent as ``data:<mime>;base64,<payload>``; every other URL is refused with :class:`MediaError`.

    The MIME type is not trusted: the payload's magic bytes decide what it is, as for an upload.
    """
    scheme, colon, rest = url.partition(":")
    scheme = scheme.strip().lower()
    if not colon or scheme != "data":
        if colon and scheme in ("http", "https"):
            hint = "the server fetches nothing from the network"
        else:
            hint = f"URL {_preview(url)} is not a data URL"
        raise MediaError(
            field,
            f"{hint}; upload the file (multipart) or send it inline as data:<mime>;base64,<payload>",
            code="unsupported_url",
        )
    header, comma, payload = rest.partition(",")
    if not comma:
        raise MediaError(field, "data URL has no ',' before its payload; send data:<mime>;base64,<payload>")
    if not header.lower().endswith(";base64"):
        raise MediaError(
            field,
            f"data URL header {_preview(header)} does not end in ';base64'; base64-encode the file "
            "and send data:<mime>;base64,<payload>",
        )
    # NOTE(size): checked before decoding, so that an oversized payload is never copied. Valid base64 (validated
    # below: no whitespace) of n bytes is exactly 4 * ceil(n / 3) characters, so this bound refuses nothing that
    # decode_media would accept.
    max_chars = 4 * ((limits.max_bytes + 2) // 3)
    if len(payload) > max_chars:
        raise MediaError(
            field,
            f"data URL payload is {len(payload)} base64 characters, over the {max_chars} that encode the limit "
            f"of {limits.max_bytes} bytes; send a smaller or shorter file",
            code="media_too_large", status=413,
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:  # ValueError: non-ASCII characters in the payload
        raise MediaError(
            field, f"data URL payload is not valid base64 ({e}); send standard base64 without line breaks"
        ) from None
    return decode_media(data, field=field, limits=limits, max_frames=max_frames)


def _preview(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _sniff(data: bytes) -> tuple[str, str] | None:
    """``(kind, format)`` from the magic bytes: the PIL format for an image, the FFmpeg demuxer for a video."""
    head = data[:16]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image", "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "image", "JPEG"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "image", "GIF"
    if head.startswith(b"BM"):
        return "image", "BMP"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "image", "WEBP"
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return "video", "avi"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "video", "matroska"  # FFmpeg's matroska demuxer reads WebM too
    if head[4:8] in _QT_ATOMS:
        if head[4:8] == b"ftyp" and head[8:12] in _STILL_BRANDS:
            return "unsupported", "HEIF/AVIF"
        return "video", "mov"  # FFmpeg's mov demuxer reads MP4, MOV, M4V and 3GP
    return None


def _check_pixels(width: int, height: int, *, field: str, limits: MediaLimits) -> None:
    if width * height > limits.max_pixels:
        raise MediaError(
            field,
            f"frames are {width}x{height} = {width * height} pixels, over the limit of {limits.max_pixels}; "
            "downscale it before sending",
            code="too_many_pixels",
        )


def _corrupt(field: str, err: BaseException) -> MediaError:
    detail = str(err) or type(err).__name__
    return MediaError(field, f"is truncated or corrupt ({detail}); re-export the file and send it again")


def _decode_image(data: bytes, fmt: str, *, field: str, limits: MediaLimits) -> np.ndarray:
    """Decode the first frame of an image (a GIF's or an animated WebP's first frame) to uint8 [1, H, W, 3]."""
    from PIL import Image, ImageOps  # the front end imports media support only when media arrives

    try:
        im = Image.open(io.BytesIO(data), formats=[fmt])
    except Image.DecompressionBombError as e:
        # PIL's own bound (Image.MAX_IMAGE_PIXELS), checked on the header inside open(): nothing was decoded.
        raise MediaError(field, f"is too large to decode ({e}); downscale it before sending",
                         code="too_many_pixels") from None
    except Exception as e:  # noqa: BLE001 -- any failure of PIL's parsers on user bytes is bad media
        raise _corrupt(field, e) from None
    with im:
        # NOTE(bomb): im.size comes from the header; nothing is decoded until load(). PIL also *warns* inside open()
        # (DecompressionBombWarning) for headers over its MAX_IMAGE_PIXELS; rather than turning that warning into
        # an error with warnings.catch_warnings (which swaps process-global filters and is not thread-safe in the
        # server's threads before Python 3.14), the same bound is applied here, so a header that warned is refused.
        width, height = im.size
        _check_pixels(width, height, field=field, limits=limits)
        pil_max = Image.MAX_IMAGE_PIXELS
        if pil_max is not None and width * height > pil_max:
            raise MediaError(
                field,
                f"frames are {width}x{height} = {width * height} pixels, over PIL's limit of {pil_max}; "
                "downscale it before sending",
                code="too_many_pixels",
            )
        try:
            im.load()
            # A phone photo's pixels are stored sideways with an EXIF orientation tag; diffusers' load_image
            # applies it too. It swaps width and height at most, so the pixel check above still holds.
            im = ImageOps.exif_transpose(im)
            rgb = _to_rgb(im)
        except Exception as e:  # noqa: BLE001 -- truncated data, bad CRCs, broken EXIF: all bad media
            raise _corrupt(field, e) from None
    return np.ascontiguousarray(rgb[None])  # H, W, 3 -> 1, H, W, 3


def _to_rgb(im) -> np.ndarray:
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # 16-bit greyscale (PNG): PIL's convert("RGB") clips at 255 instead of scaling; keep the top 8 bits.
        grey = (np.clip(np.asarray(im, dtype=np.int64), 0, 65535) >> 8).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    # Alpha is dropped, not composited: the colour channels are kept as they are (diffusers' load_image does
    # the same with convert("RGB")).
    return np.array(im.convert("RGB"), dtype=np.uint8)


def _decode_video(
    data: bytes, fmt: str, *, field: str, limits: MediaLimits, max_frames: int, from_request: bool
) -> np.ndarray:
    """Decode a clip's first video stream to uint8 [F, H, W, 3], F <= max_frames."""
    import av  # heavy; imported only when a clip arrives

    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r", format=fmt) as container:
            if not container.streams.video:
                raise MediaError(field, "has no video stream; send a clip with video in it (an image works too)")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width < 1 or height < 1:
                # Without the size in the header the pixel bound could only be checked after decoding a frame.
                raise MediaError(field, f"video stream does not state its frame size ({width}x{height}); "
                                        "re-encode it as MP4 (H.264) and send it again")
            _check_pixels(width, height, field=field, limits=limits)
            for frame in container.decode(stream):
                if (frame.width, frame.height) != (width, height):
                    # The header's size is what was checked; a stream that changes size is refused, not resized.
                    raise MediaError(field, f"frame {len(frames)} is {frame.width}x{frame.height} but the stream "
                                            f"is {width}x{height}; re-encode it at one frame size")
                if len(frames) == max_frames:
                    raise _too_many_frames(field, max_frames, from_request)
                frames.append(frame.to_ndarray(format="rgb24"))
    except MediaError:
        raise
    except Exception as e:  # noqa: BLE001 -- av.FFmpegError, OSError, ValueError, ...: all bad media
        raise _corrupt(field, e) from None
    if not frames:
        raise MediaError(field, "has a video stream but no frame could be decoded; re-encode it and send it again")
    return np.stack(frames)  # F x [H, W, 3] -> F, H, W, 3


def _too_many_frames(field: str, max_frames: int, from_request: bool) -> MediaError:
    if from_request:
        fix = f"trim it to at most {max_frames} frames or ask for more frames (num_frames)"
    else:
        fix = f"the server decodes at most {max_frames}; trim it to at most {max_frames} frames"
    return MediaError(field, f"clip has more than {max_frames} frames; {fix}", code="too_many_frames")

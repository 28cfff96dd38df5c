"""Fragmented MP4 streaming: bytes leave the encoder while frames are still coming, and the result is a
valid MP4 with every frame."""

import io

import av
import numpy as np
import pytest

from cp_infer.stream import FragmentedMP4Writer


def _frames(n, h=64, w=96, seed=0):
    # Smooth, moving content: a random mix of gradients (pure noise does not survive 4:2:0 chroma subsampling).
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    phase = rng.uniform(0, 6, size=3)
    return np.stack([
        np.stack([127 + 120 * np.sin(4 * x + 3 * y + phase[c] + 0.2 * i) for c in range(3)], axis=-1)
        for i in range(n)]).astype(np.uint8)


def test_bytes_flow_before_the_last_chunk_and_file_is_valid():
    chunks, seen_after_first_chunk = [], None
    writer = FragmentedMP4Writer(chunks.append, width=96, height=64, fps=24)
    video = _frames(25)
    writer.write(video[:9])
    seen_after_first_chunk = sum(len(c) for c in chunks)
    writer.write(video[9:])
    writer.close()
    assert seen_after_first_chunk > 0, "no bytes were emitted before the last chunk was written"
    data = b"".join(chunks)
    assert len(data) > seen_after_first_chunk
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert stream.codec_context.pix_fmt == "yuv420p"
        assert (stream.width, stream.height) == (96, 64)
        assert stream.average_rate == 24
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert decoded.shape == video.shape
    assert np.abs(decoded.astype(int) - video.astype(int)).mean() < 3  # lossy codec, but the same pictures


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="even width and height"):
        FragmentedMP4Writer(lambda b: None, width=95, height=64, fps=24)
    writer = FragmentedMP4Writer(lambda b: None, width=96, height=64, fps=24)
    with pytest.raises(ValueError, match="do not match"):
        writer.write(np.zeros((2, 32, 96, 3), np.uint8))
    writer.close()

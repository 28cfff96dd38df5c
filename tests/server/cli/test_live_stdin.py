"""``cp-infer generate --live``'s directions from standard input (``server.cli.live_stdin``): the lines it takes, the
ones it reports and ignores, and the answers the sampler gets (the video each direction makes, a wait, the end)."""

from __future__ import annotations

import io
import os
import time

import numpy as np
import pytest

from cp_infer.live import WAIT, Direction, live_request
from cp_infer.request import GenerationRequest, resolve_request
from models.helios.options import helios_options
from server.cli.live_stdin import StdinDirections, parse_direction


@pytest.mark.parametrize("line, expected", [
    ("3 | the fox jumps\n", Direction("the fox jumps", 3)),
    ("night falls", Direction("night falls", 1)),
    ("   \n", None),
])
def test_a_line_is_a_direction(line, expected):
    assert parse_direction(line) == expected


@pytest.mark.parametrize("line, words", [("x | a fox", "K | prompt"), ("0 | a fox", "windows=0"), ("2 |  ", "prompt"),
                                         ("2 | a fox | image:", "image: PATH"), ("| image: a.png", "with a prompt"),
                                         ("a fox | image: missing.png", "cannot read 'missing.png'")])
def test_a_bad_line_names_the_fix(line, words):
    with pytest.raises(ValueError, match=words):
        parse_direction(line)


def test_a_line_may_give_the_image_its_windows_start_from(tmp_path):
    from PIL import Image

    pixels = np.random.default_rng(1).integers(0, 256, (12, 20, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "night.png")
    for line, prompt, windows in ((f"2 | night | falls | image: {tmp_path / 'night.png'}", "night | falls", 2),
                                  (f"night falls |image:{tmp_path}/night.png", "night falls", 1)):
        direction = parse_direction(line)
        assert (direction.prompt, direction.windows) == (prompt, windows), direction
        np.testing.assert_array_equal(direction.image.frames, pixels[None])


def test_the_lines_direct_the_video_until_their_end(capsys):
    options = helios_options()
    base = resolve_request(GenerationRequest(prompt="a fox", num_frames=9, height=32, width=32,
                                             options={"num_latent_frames_per_chunk": 3}), options)
    first = [Direction("a fox", 1)]
    checked = []

    def check(request):
        checked.append(request.num_frames)
        if request.num_frames > 33:
            raise ValueError(f"num_frames={request.num_frames} is over the limit of 33")
        return request

    lines = io.StringIO("2 | it jumps\nbad | x\n9 | far too long\n2 | dawn | image: gone.png\n\nnight falls\nend\n"
                        "never read\n")
    directions = StdinDirections(base, list(first), options=options, check=check, idle_s=60, lines=lines)
    time.sleep(0.2)  # the reader thread has read every line
    grown = directions.extend(1, live_request(base, first, options))
    whole = [Direction("a fox", 1), Direction("it jumps", 2), Direction("night falls", 1)]
    assert grown == live_request(base, whole, options) and grown.num_frames == 33, grown
    assert directions.extend(4, grown) is None  # the end: nothing more directed
    err = capsys.readouterr().err
    assert "ignored 'bad | x'" in err and "ignored '9 | far too long'" in err and "over the limit" in err, err
    # Each refused line is quoted once, before what to fix.
    assert "ignored '2 | dawn | image: gone.png': image: cannot read 'gone.png'" in err, err
    assert all(line.count("'bad | x'") <= 1 and line.count("'2 | dawn | image: gone.png'") <= 1
               for line in err.splitlines()), err
    assert "windows 1..2: 'it jumps'" in err and "windows 3..3: 'night falls'" in err, err


def test_an_open_input_waits_then_ends_after_the_idle_time():
    options = helios_options()
    base = resolve_request(GenerationRequest(prompt="a fox", num_frames=9, height=32, width=32,
                                             options={"num_latent_frames_per_chunk": 3}), options)
    r, w = os.pipe()  # an input with nothing yet and no end: a pipe kept open
    directions = StdinDirections(base, [Direction("a fox", 1)], options=options, check=lambda r: r, idle_s=0.6,
                                 lines=os.fdopen(r))
    try:
        assert directions.extend(1, base) is WAIT
        time.sleep(0.6)
        assert directions.extend(1, base) is None
    finally:
        os.close(w)

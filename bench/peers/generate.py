"""The peer of ``cp-infer generate --nproc N --out x.mp4`` in ``bench/cli.py``: what a diffusers user runs under
``torchrun --nproc_per_node N``: ``LTXPipeline.from_pretrained``, diffusers' own context parallelism (made to run
on CPU/gloo by ``bench/peers/diffusers_cp.py``, nothing else changed), ``pipe(...)`` and, on rank 0,
``diffusers.utils.export_to_video``.

    torchrun --nproc_per_node 2 bench/peers/generate.py --model DIR --prompt TEXT --frames 25 --height 256 --width 256
             --steps 40 --out x.mp4

With ``CP_INFER_TIMINGS=DIR`` every rank writes its phase marks as the CLI's ranks do (``server.group.phases``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from server.group import phases  # noqa: E402 -- path set-up; json, os and time only

phases.mark("imports")  # the interpreter and this script up to here (torchrun's own start-up is before it)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from diffusers import LTXPipeline  # noqa: E402
from diffusers.utils import export_to_video  # noqa: E402

from bench.peers.diffusers_cp import enable_diffusers_context_parallel  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--frames", type=int, required=True)
    ap.add_argument("--height", type=int, required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fps", type=int, default=25)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    phases.mark("torch and diffusers imports")
    dist.init_process_group("gloo")
    phases.mark("rendezvous and groups")
    pipe = LTXPipeline.from_pretrained(args.model, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    phases.mark("load")
    world = dist.get_world_size()
    if world > 1:
        enable_diffusers_context_parallel(pipe.transformer, ulysses_degree=world)
    phases.mark("enable_parallelism")
    with torch.inference_mode():
        video = pipe(prompt=args.prompt, num_frames=args.frames, height=args.height, width=args.width,
                     num_inference_steps=args.steps, frame_rate=args.fps,
                     generator=torch.Generator("cpu").manual_seed(args.seed)).frames[0]
    phases.mark("pipe() (encode, steps, decode)")
    if dist.get_rank() == 0:
        export_to_video(video, args.out, fps=args.fps)
        phases.mark("export_to_video")
    dist.destroy_process_group()
    phases.mark("teardown")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    sys.exit(main())

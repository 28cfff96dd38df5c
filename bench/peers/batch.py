"""The peer of ``cp-infer batch PROMPTS.jsonl --nproc N`` in ``bench/serve_batch.py``: what a diffusers user runs
under ``torchrun --nproc_per_node N`` to make a video per line of a prompts file: ``LTXPipeline.from_pretrained``
once, diffusers' own context parallelism (``bench/peers/diffusers_cp.py``), then for each line ``pipe(...)`` and,
on rank 0, ``diffusers.utils.export_to_video`` to ``OUT_DIR/NAME.mp4``.

    torchrun --nproc_per_node 2 bench/peers/batch.py --model DIR PROMPTS.jsonl --out-dir DIR

Each line is the subset of ``cp-infer batch``'s keys the benchmark writes: ``prompt``, ``name``, ``seed``,
``num_frames``, ``height``, ``width``, ``num_inference_steps``, ``frame_rate``. With ``CP_INFER_TIMINGS=DIR`` every
rank writes its phase marks as the CLI's ranks do (``server.group.phases``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from server.group import phases  # noqa: E402 -- path set-up; json, os and time only

phases.mark("imports")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from diffusers import LTXPipeline  # noqa: E402
from diffusers.utils import export_to_video  # noqa: E402

from bench.peers.diffusers_cp import enable_diffusers_context_parallel  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("prompts", type=Path)
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args()
    lines = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
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
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for line in lines:
        with torch.inference_mode():
            video = pipe(prompt=line["prompt"], num_frames=line["num_frames"], height=line["height"],
                         width=line["width"], num_inference_steps=line["num_inference_steps"],
                         frame_rate=line["frame_rate"],
                         generator=torch.Generator("cpu").manual_seed(line["seed"])).frames[0]
        if dist.get_rank() == 0:
            export_to_video(video, str(args.out_dir / f"{line['name']}.mp4"), fps=line["frame_rate"])
    phases.mark(f"{len(lines)} x (pipe() and export_to_video)")
    dist.destroy_process_group()
    phases.mark("teardown")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    sys.exit(main())

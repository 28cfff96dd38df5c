"""The peer of ``cp-infer serve --nproc N`` in ``bench/serve_batch.py``: what a diffusers user runs under ``torchrun
--nproc_per_node N`` to serve ``LTXPipeline`` with diffusers' own context parallelism: every rank loads the pipeline
and enables its parallelism (``bench/peers/diffusers_cp.py``), then rank 0 answers ``GET /ready`` with 200 (the standard
library's ``http.server``) while the other ranks wait for it in a barrier. SIGTERM ends rank 0's server; the barrier
then lets every rank exit.

    torchrun --nproc_per_node 2 bench/peers/serve.py --model DIR --port 8000

With ``CP_INFER_TIMINGS=DIR`` every rank writes its phase marks as the CLI's ranks do (``server.group.phases``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from server.group import phases  # noqa: E402 -- path set-up; json, os and time only

phases.mark("imports")

import http.server  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from diffusers import LTXPipeline  # noqa: E402

from bench.peers.diffusers_cp import enable_diffusers_context_parallel  # noqa: E402


class _Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        body = b'{"status": "ready"}' if self.path == "/ready" else b'{"error": "not found"}'
        self.send_response(200 if self.path == "/ready" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # quiet, as uvicorn without --access-log
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
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
    if dist.get_rank() == 0:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), _Ready)
        phases.mark("listening")

        def stop(_signum, _frame) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
        server.server_close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    sys.exit(main())

"""``cp-infer serve``: the worker group behind an HTTP front end on rank 0.

Invariants:
- ``--nproc N`` (N > 1) outside torchrun re-executes the CLI under torchrun, and starts the group again when its
  ranks fail: at most ``--max-restarts`` times within any ``--restart-window-s`` seconds (``server.group.restarts``;
  each restart is a fresh torchrun agent and rendezvous). Under torchrun (directly, or relaunched) every rank runs
  :func:`run`; started by torchrun directly, restarts are torchrun's own (its ``--max-restarts``).
- Every rank of a restarted group sees the restarts so far as ``TORCHELASTIC_RESTART_COUNT`` (what the leader
  reports in ``group.json`` and ``/metrics``), whichever of the two made them.
- Rank 0: the main thread runs uvicorn (so SIGTERM/SIGINT shut the server down cleanly) and the leader thread
  (``server.group.leader``) issues every collective. The leader of each other replica group
  (``server.group.replicas``) runs
  rank 0's commands on its replica (``replica_loop``). Other ranks: the main thread loads the model and follows
  their replica leader's commands (``worker_loop``) until ``stop``; a broken group (its leader gone) makes their
  next collective fail, and they exit non-zero.
- Every rank builds the same configs from the same arguments, so limits and model agree across the group.
- The model is fetched and checked before any group forms (``server.cli.common.fetch_model``: a hub repo downloaded
  once, here): a model that cannot be had (a missing path or hub id, a gated repo, an id not cached while offline)
  is one line on stderr, and the front end alone serves: ``/health`` 200, everything else ``503 model_unavailable``
  with that line (``server.http.unavailable``), not a group that fails and restarts. A bad argument is exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields
from pathlib import Path

from models.families import default_model_name
from server.group import phases, process
from server.group.restarts import RestartPolicy

__all__ = ["add_arguments", "run"]

log = logging.getLogger("cp_infer.serve")

_USAGE_ERROR = 2
_DEFAULT_RESTARTS = RestartPolicy()
# NOTE(restarts): torchrun's own restarts (torch 2.13) hand every round of ranks the agent's TCPStore with the same
# keys, so after a restart gloo may read the dead ranks' addresses ("connectFullMesh ... Connection refused"; pytorch
# issue 135712); with this set, each round gets a fresh store hosted by its rank 0, at a cost (rank 0's store daemon
# and every rank's connection to it: ~0.4 s of the rendezvous here). `--nproc` needs neither: each of its rounds is a
# new agent with a new store (server.cli.launch), torchrun's own restarts being off.
_FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_LIMIT_HELP = {"max_frames": "longest video in frames", "max_side": "largest width or height in pixels",
               "max_tokens": "largest latent token count (frames x height x width after the VAE)",
               "max_steps": "most denoising steps", "max_guidance": "largest guidance scale",
               "max_prompt_chars": "longest prompt (and negative prompt)", "max_fps": "highest frame rate"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's options (the CLI calls this on its ``serve`` subparser)."""
    from cp_infer.request import GenerationLimits
    from server.cli.common import add_runtime_arguments

    add_runtime_arguments(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--data-dir", type=Path, default=Path("cp-infer-data"),
                       help="jobs database and videos (default ./cp-infer-data)")
    group.add_argument("--job-store", default=os.environ.get("CP_INFER_JOB_STORE"), metavar="URL",
                       help="where jobs live: postgresql://USER:PASS@HOST/DB for a fleet of servers sharing one queue "
                       "(default $CP_INFER_JOB_STORE, else the SQLite file in --data-dir: this server alone)")
    group.add_argument("--output-store", default=os.environ.get("CP_INFER_OUTPUT_STORE"), metavar="URL",
                       help="where videos and long videos' checkpoints live: s3://BUCKET/PREFIX (credentials and "
                       "endpoint from AWS_* variables, AWS_ENDPOINT_URL for any S3-compatible server; default "
                       "$CP_INFER_OUTPUT_STORE, else --data-dir/videos)")
    group.add_argument("--lease-s", type=float, default=30.0,
                       help="with a shared --job-store: seconds a running job's claim holds without renewal; a server "
                       "silent that long loses its jobs to the others (default 30)")
    group.add_argument("--api-key", default=os.environ.get("CP_INFER_API_KEY"),
                       help="bearer token every route but /health requires (default $CP_INFER_API_KEY; none: open)")
    group.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="allow browser requests from ORIGIN (repeatable; default: no CORS)")
    group.add_argument("--max-queue", type=int, default=16, help="queued jobs before 429 (default 16)")
    group.add_argument("--max-body-bytes", type=int, default=64 * 1024,
                       help="largest request body without media (default 64 KiB)")
    group.add_argument("--max-upload-bytes", type=int, default=32 * 2**20,
                       help="largest uploaded image or clip, as a file or a data URL (default 32 MiB)")
    group.add_argument("--heartbeat-s", type=float, default=2.0, help="idle heartbeat period (default 2 s)")
    group.add_argument("--collective-timeout", type=float, default=120.0,
                       help="seconds before a silent rank fails the group (default 120)")
    group.add_argument("--max-restarts", type=int, default=_DEFAULT_RESTARTS.max_restarts,
                       help="restarts of the group after a rank dies, at most this many within any "
                       f"--restart-window-s (with --nproc; 0: none; default {_DEFAULT_RESTARTS.max_restarts})")
    group.add_argument("--restart-window-s", type=float, default=_DEFAULT_RESTARTS.window_s,
                       help="the window --max-restarts counts in: one more failure within it ends the server "
                       f"(default {_DEFAULT_RESTARTS.window_s:g} s)")
    group.add_argument("--keep-frames", action="store_true",
                       help="also keep raw frames (.npy) for GET .../content?variant=frames (lossless; large)")
    group.add_argument("--served-model-name", default=None, help="the 'model' clients send (default: --model "
                       "as written for a hub id, else the folder's name or the file's stem, or "
                       f"{default_model_name()})")
    group.add_argument("--live-idle-s", type=float, default=120.0,
                       help="a live video whose every directed window is made ends there, completed, after this "
                       "long without a new direction (default 120 s)")
    group.add_argument("--live-max-seconds", type=float, default=600.0,
                       help="the longest live video a request or its directions may ask for (default 600 s)")
    group.add_argument("--access-log", action="store_true", help="log every HTTP request")
    limits = parser.add_argument_group("request limits (a value a request gives past one gets a 400 naming it; a "
                                       "default past one is lowered to it)")
    defaults = GenerationLimits()
    for f in fields(GenerationLimits):
        default = getattr(defaults, f.name)
        limits.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(default), default=default,
                            help=f"{_LIMIT_HELP.get(f.name, '')} (default {default})")




def _configs(args: argparse.Namespace):
    from cp_infer.request import GenerationLimits
    from server.cli.common import check_layout
    from server.group.leader import LeaderConfig
    from server.group.runtime import RuntimeConfig
    from server.http.app import AppConfig

    check_layout(args, replicas=True)
    limits = GenerationLimits(**{f.name: getattr(args, f.name) for f in fields(GenerationLimits)})
    runtime = RuntimeConfig(model=args.model, model_config=args.model_config, upsampler=args.upsampler,
                            dtype=args.dtype, device=args.device,
                            timeout_s=args.collective_timeout, limits=limits,
                            decode_frames_per_rank=args.decode_frames_per_rank, vae_tiling=args.vae_tiling,
                            guidance_degree=args.guidance_degree, ulysses_degree=args.ulysses_degree,
                            ring_degree=args.ring_degree,
                            compile_blocks=args.compile_blocks, lora_dir=args.lora_dir,
                            max_lora_bytes=args.max_lora_bytes, max_lora_rank=args.max_lora_rank,
                            stage_2_loras=tuple(args.stage_2_loras or ()),
                            weights=args.weights, offload=args.offload)
    leader = LeaderConfig(runtime=runtime, data_dir=args.data_dir, heartbeat_s=args.heartbeat_s,
                          max_queue=args.max_queue, keep_frames=args.keep_frames, model_name=args.served_model_name,
                          job_store=args.job_store, output_store=args.output_store, lease_s=args.lease_s,
                          live_idle_s=args.live_idle_s)
    app = AppConfig(api_key=args.api_key or None, max_body_bytes=args.max_body_bytes,
                    max_upload_bytes=args.max_upload_bytes, cors_origins=tuple(args.cors_origin),
                    live_max_seconds=args.live_max_seconds)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} must be in [1, 65535]")
    restarts = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s)
    return runtime, leader, app, restarts


def run(args: argparse.Namespace) -> int:
    """Run ``cp-infer serve``; returns the exit code."""
    from models.common.folder_problems import ModelLoadError
    from server.cli.common import check_device, check_stage_2_loras, check_vae_tiling, fetch_model, model_info
    from server.cli.launch import (
        count_launcher_restarts,
        group_size,
        in_torchrun,
        relaunch_under_torchrun,
        under_launcher,
    )

    try:
        nproc = group_size(args.nproc)
        runtime, leader, app, restarts = _configs(args)
        check_device(runtime, nproc=nproc)
        if not under_launcher():  # the launcher's own process fetched it for its ranks
            try:
                fetch_model(runtime)
            except ModelLoadError as exc:  # the model cannot be had: say so where clients and operators look
                print(f"cp-infer serve: error: {exc}", file=sys.stderr)
                return _serve_unavailable(args, str(exc))
            info = model_info(runtime)
            check_stage_2_loras(runtime, info)
            check_vae_tiling(runtime, info)
    except ValueError as exc:  # a bad argument
        print(f"cp-infer serve: error: {exc}", file=sys.stderr)
        return _USAGE_ERROR
    phases.mark("checks")
    if not in_torchrun() and nproc > 1:
        # A server's rank logs live with its jobs (one folder across restarts), unless the operator names another.
        os.environ.setdefault(process.LOG_DIR_ENV, str(leader.data_dir / "logs"))
        return relaunch_under_torchrun(nproc, list(getattr(args, "cli_argv", None) or sys.argv[1:]),
                                       restarts=restarts)
    if in_torchrun():
        count_launcher_restarts()  # before the leader reads TORCHELASTIC_RESTART_COUNT
    if (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        log.warning("torchrun shares its store with the ranks across restarts, so a restarted gloo group can read "
                    "the dead group's addresses and fail to connect; set %s=1 in torchrun's environment",
                    _FRESH_STORE_ENV)
    if int(os.environ.get("RANK", "0")) == 0:
        return _run_leader(args, leader, app)
    return _run_worker(runtime)


def _serve_unavailable(args: argparse.Namespace, reason: str) -> int:
    """Serve ``503 model_unavailable`` with ``reason`` until stopped (SIGTERM/SIGINT)."""
    import uvicorn

    from server.http.unavailable import create_unavailable_app

    config = uvicorn.Config(create_unavailable_app(reason), host=args.host, port=args.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=3, lifespan="on")
    uvicorn.Server(config).run()
    return 0


def _run_worker(runtime_config) -> int:
    from cp_infer import destroy_parallel
    from server.group.leader import group_pids
    from server.group.replicas import replica_loop
    from server.group.runtime import start_runtime, worker_loop

    runtime = start_runtime(runtime_config)
    group_pids(runtime.state)
    if runtime.state.leads_replica:
        replica_loop(runtime)
    else:
        worker_loop(runtime)
    destroy_parallel(runtime.state)
    return 0


def _run_leader(args: argparse.Namespace, leader_config, app_config) -> int:
    import uvicorn

    from server.group.jobs import JobStore
    from server.group.leader import FATAL_EXIT_CODE, GroupLeader
    from server.http.app import create_app

    leader_config.data_dir.mkdir(parents=True, exist_ok=True)
    store = JobStore(leader_config.data_dir, max_queue=leader_config.max_queue, job_store=leader_config.job_store,
                     output_store=leader_config.output_store, lease_s=leader_config.lease_s)
    leader = GroupLeader(leader_config, store)
    leader.preload()  # the other ranks wait at the rendezvous for this one: join them before building the app
    app = create_app(app_config, leader)
    if args.host not in ("127.0.0.1", "localhost", "::1") and app_config.api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach it can submit jobs", args.host)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=args.access_log,
                            timeout_graceful_shutdown=3, lifespan="on")
    server = uvicorn.Server(config)
    server.run()
    store.close()
    if leader.fatal and not server.should_exit:
        return FATAL_EXIT_CODE
    return 0

"""Benchmark: the ring axis across two nodes: one Ulysses group over both (U=4) against Ulysses inside each node and a
ring across them (U=2 x R=2), over a link capped at 200 Mbit, 1 Gbit and 10 Gbit.

Run as root from the repository root (it needs iproute2's ``ip`` and ``tc`` and the right to make network
namespaces)::

    python bench/two_nodes.py [--quick] [--rounds N] [--steps N] [--caps 200mbit,1gbit,10gbit] [--out FILE.md]

Set-up: two network namespaces, the "nodes" A and B, joined by a veth pair (10.77.0.1 on A, 10.77.0.2 on B); each
end sends through a ``tbf`` qdisc at the cap, changed with ``tc qdisc replace`` between measurements. In each node a
torchrun agent (``--nnodes 2 --nproc_per_node 2``, static rendezvous at A's address) starts 2 ranks: ranks 0-1 on A,
2-3 on B, gloo bound to the veth (``GLOO_SOCKET_IFNAME``), so traffic between two ranks of one node stays on the
node and traffic between the nodes crosses the capped link.

Workload (ours, fp32, CPU/gloo, 1 thread per rank): ``bench/_models.py``'s random-weight
``LTXVideoTransformer3DModel`` with 4 heads of 64 (4 layers; ``--quick``: 2) on its comm-bound video (25 frames at
256x512 -> 512 latent tokens, CFG on: a batch of 2 through every block). Layouts (``--ulysses-degree`` and
``--ring-degree`` of 4 ranks): U=4 (both all-to-alls of every attention layer span the nodes) and U=2 x R=2 (the
all-to-alls stay inside a node; each layer passes one key/value block across, overlapped with the attention).

Link bytes, counted: the veth's ``tx_bytes`` of both ends (each node's ``/sys/class/net``), read by each node's first
rank at the end of every step; a step's bytes are the counters' growth from the first timed step's end to the last
one's, over the steps between (Ethernet, IP and TCP headers and ACKs included). The arithmetic: per self-attention
layer, with B batch rows, L tokens and H heads (padded to multiples of U x R and of U) of D floats, U=4 sends q, k
and v of each rank's L/4 tokens to the two ranks of the other node (half of each rank's 3 x B L H D / 4) and the
output back (half of B L H D / 4): 2 B L H D floats across the link over the 4 ranks; U=2 x R=2 passes each rank's
ring block of keys and values (L/2 tokens, H/2 heads) to its ring peer on the other node once: 2 B L H D floats too.
Cross-attention to the text is local. The counted bytes are the arithmetic plus the headers, the ACKs and a few
control messages (measured: under 1% more at 200 Mbit and up, 4-5% at 50 Mbit).

Procedure: both layouts' groups load at once and idle (blocked in a gloo receive) while the other runs; one 2-step
warm-up each at load. For each cap, ``--rounds`` timed generations of ``--steps`` steps per layout, alternating
(round r starts with layout r mod 2). step: one denoising step, slowest rank, median over every timed step. The
1-minute load average at the start of each layout's timed rounds is in the table. The two layouts' videos are checked
against each other (each equals 1 rank within 1 level at fp32: ``tests/models/ltx_video/test_parallel.py``; here
within 2 of each other).

What carries over to GPUs: the bytes per step (they depend on the layout and the shapes, not on the device) and the
direction of the ratio on a slow link. What does not: 4 ranks share 2 cores here, so compute and gloo's copies
compete for the same cores and a 10 Gbit link is not saturated; on GPUs NCCL moves the bytes while the GPUs compute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.harness import (  # noqa: E402 -- path set-up
    REPO,
    TIMEOUT_S,
    command_line,
    free_port,
    load_average,
    print_report,
    progress,
    rotated,
    slowest_steps,
    table_head,
    table_row,
)

__all__ = ["link_bytes", "main"]

_U4, _U2R2 = "U=4", "U=2 x R=2"
_LAYOUTS = {_U4: (4, None), _U2R2: (2, 2)}  # label -> (ulysses, ring) of 4 ranks
_HEADS, _HEAD_DIM, _BATCH, _TOKENS = 4, 64, 2, 512
_NODES = (("a", "10.77.0.1"), ("b", "10.77.0.2"))  # veth end's suffix, address
_POLL_S = 0.05
_DUPLEX = "duplex"
_DUPLEX_BYTES = 1 << 20


def link_bytes(layers: int, *, ulysses: int, ring: int, batch: int = _BATCH, tokens: int = _TOKENS,
               heads: int = _HEADS, head_dim: int = _HEAD_DIM) -> int:
    """Payload bytes (fp32) that one denoising step sends across the two nodes, both ways together (see the module
    docstring): U=4 and U=2 x R=2 of 2 ranks per node."""
    padded_tokens = -(-tokens // (ulysses * ring)) * ulysses * ring
    padded_heads = -(-heads // ulysses) * ulysses
    return layers * 2 * batch * padded_tokens * padded_heads * head_dim * 4


# --------------------------------------------------------------------------------------------------------- ranks


def _duplex(box: Path) -> None:
    """One rank of two (one per node) under torchrun: time gloo sending ``_DUPLEX_BYTES`` one way (rank 0 to 1) and
    both ways at once (an ``isend`` and an ``irecv`` on the pair, as a ring step of 2 posts them), median of 5 each;
    rank 0 writes ``reply-0.json``."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mine, theirs = torch.ones(_DUPLEX_BYTES // 4), torch.empty(_DUPLEX_BYTES // 4)

    def one_way() -> None:
        dist.send(mine, 1) if rank == 0 else dist.recv(theirs, 0)

    def both_ways() -> None:
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 1 - rank),
                                             dist.P2POp(dist.irecv, theirs, 1 - rank)]):
            work.wait()

    times: dict[str, list[float]] = {"one way": [], "both ways at once": []}
    for _ in range(5):
        for name, exchange in (("one way", one_way), ("both ways at once", both_ways)):
            dist.barrier()
            started = time.perf_counter()
            exchange()
            dist.barrier()
            times[name].append(time.perf_counter() - started)
    if rank == 0:
        (box / "reply-0.json").write_text(json.dumps({k: statistics.median(v) for k, v in times.items()}))
    dist.destroy_process_group()


def _worker(box: Path, label: str, quick: bool) -> None:
    """One rank under torchrun: load, warm up, then run the generations the controller asks for in ``box`` (rank 0
    reads ``cmd-N.json`` and broadcasts it; ``None`` ends the group) and answer in ``reply-N.json``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from bench import _models as m
    from cp_infer import ParallelConfig, init_parallel
    from cp_infer.sampler import SampleControl, sample
    from models.ltx_video.adapter import LTXVideoModel

    ulysses, ring = _LAYOUTS[label]
    state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=TIMEOUT_S, ulysses_degree=ulysses,
                                         ring_degree=ring))
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    counter = Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes")
    size = m.ModelSize(layers=2 if quick else 4, heads=_HEADS)
    workload = m.Workload(m.COMM, frames=25, height=256, width=512, model=size)
    model = LTXVideoModel(SimpleNamespace(**m.build_components(size)), state=state)
    model.decode_frames_per_rank = None
    sample(model, m.make_request(workload, 2), state=state)  # warm-up
    seq = 0
    while True:
        command: list[Any] = [None]
        if rank == 0:
            path = box / f"cmd-{seq}.json"
            while not path.exists():
                time.sleep(_POLL_S)
            command = [json.loads(path.read_text())["steps"]]
        dist.broadcast_object_list(command, src=0)
        if command[0] is None:
            break
        times: list[float] = []
        counts: list[int] = []

        def on_step(_done: int, _total: int, seconds: float, times=times, counts=counts) -> None:
            times.append(seconds)
            if local == 0:
                counts.append(int(counter.read_text()))

        dist.barrier()
        frames = sample(model, m.make_request(workload, command[0]), state=state,
                        control=SampleControl(on_step=on_step))
        replies: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(replies, dict(steps=times, counts=counts))
        if rank == 0:
            np.save(box / f"frames-{seq}.npy", frames)
            (box / f"reply-{seq}.json.tmp").write_text(json.dumps(replies))
            (box / f"reply-{seq}.json.tmp").rename(box / f"reply-{seq}.json")
        seq += 1
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------- nodes


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class Link:
    """Two network namespaces joined by a capped veth pair (removed on exit)."""

    def __init__(self) -> None:
        tag = f"cpi{os.getpid()}"
        self.names = [f"{tag}{suffix}" for suffix, _ in _NODES]
        self.ifaces = [f"v{tag}{suffix}" for suffix, _ in _NODES]

    def __enter__(self) -> Link:
        try:
            for ns in self.names:
                _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", self.ifaces[0], "type", "veth", "peer", "name", self.ifaces[1])
            for ns, iface, (_, address) in zip(self.names, self.ifaces, _NODES, strict=True):
                _run("ip", "link", "set", iface, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", iface)
                _run("ip", "-n", ns, "link", "set", iface, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.__exit__()
            raise RuntimeError(f"{' '.join(exc.cmd)}: {exc.stderr.strip()}") from None
        return self

    def cap(self, rate: str) -> None:
        """Both ends send at most ``rate`` (tc's units: ``200mbit``, ``1gbit``); the bucket holds 4 ms of it."""
        bits = _rate_bits(rate)
        burst = max(bits // 8 // 250, 64 << 10)
        for ns, iface in zip(self.names, self.ifaces, strict=True):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", iface, "root", "tbf", "rate", rate, "burst", str(burst),
                 "latency", "50ms")

    def __exit__(self, *exc: object) -> None:
        # A namespace takes the veth end in it along; a pair not yet moved is deleted by name (else: no such device).
        subprocess.run(["ip", "link", "del", self.ifaces[0]], capture_output=True)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _rate_bits(rate: str) -> int:
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"--caps: {rate!r} is not a rate such as 200mbit or 10gbit")


class Agents:
    """One layout's two torchrun agents, one per node, and the files the controller talks to rank 0 through."""

    def __init__(self, label: str, link: Link, work: Path, quick: bool, *, ranks_per_node: int = 2) -> None:
        self.label, self.seq = label, 0
        self.box = work / label.replace(" ", "").replace("=", "")
        self.box.mkdir(parents=True)
        port = free_port()
        self.procs, self.logs = [], []
        for node, (ns, iface) in enumerate(zip(link.names, link.ifaces, strict=True)):
            log = self.box / f"node{node}.log"
            env = {**os.environ, "GLOO_SOCKET_IFNAME": iface, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            command = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                       "--nproc_per_node", str(ranks_per_node), "--node_rank", str(node), "--master_addr",
                       _NODES[0][1], "--master_port", str(port), "--max-restarts", "0", str(Path(__file__).resolve()),
                       "--worker", str(self.box), label] + (["--quick"] if quick else [])
            self.logs.append(log)
            self.procs.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=log.open("w"),
                                               stderr=subprocess.STDOUT, start_new_session=True))

    def call(self, steps: int | None) -> tuple[list[dict[str, Any]], np.ndarray] | None:
        (self.box / f"cmd-{self.seq}.json").write_text(json.dumps({"steps": steps}))
        seq, self.seq = self.seq, self.seq + 1
        if steps is None:
            return None
        return self.reply(seq), np.load(self.box / f"frames-{seq}.npy")

    def reply(self, seq: int) -> Any:
        """``reply-SEQ.json``, once rank 0 has written it."""
        reply = self.box / f"reply-{seq}.json"
        deadline = time.monotonic() + TIMEOUT_S
        while not reply.exists():
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                logs = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in self.logs)
                raise RuntimeError(f"{self.label}: the group ended or timed out without answering\n{logs}")
            time.sleep(_POLL_S)
        return json.loads(reply.read_text())

    def close(self) -> None:
        if self.label != _DUPLEX and all(p.poll() is None for p in self.procs):
            self.call(None)
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


# --------------------------------------------------------------------------------------------------------- report


def _step_bytes(replies: list[dict[str, Any]]) -> float:
    """Bytes over the link per step, both ways: each node's first rank's counter growth between step ends."""
    grown = [r["counts"][-1] - r["counts"][0] for r in replies if r["counts"]]
    return sum(grown) / (len(replies[0]["steps"]) - 1)


def _measure(args: argparse.Namespace) -> dict[tuple[str, str], dict[str, Any]]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    work = Path(tempfile.mkdtemp(prefix="cp-infer-two-nodes-"))
    try:
        with Link() as link:
            link.cap(args.caps[0])  # the groups meet and load over the link as it will be measured
            groups = {label: Agents(label, link, work, args.quick) for label in _LAYOUTS}
            try:
                for cap in args.caps:
                    link.cap(cap)
                    pair = Agents(_DUPLEX, link, work / cap, args.quick, ranks_per_node=1)
                    try:
                        rows[cap, _DUPLEX] = pair.reply(0)
                    finally:
                        pair.close()
                    for r in range(args.rounds):
                        for label in rotated(list(groups), r):
                            row = rows.setdefault((cap, label), {"steps": [], "bytes": [], "load": []})
                            row["load"].append(os.getloadavg()[0])
                            replies, row["frames"] = groups[label].call(args.steps)
                            slowest = slowest_steps(replies)
                            row["steps"] += slowest
                            row["bytes"].append(_step_bytes(replies))
                            progress(f"{cap} round {r} {label}: step {statistics.median(slowest):.3f} s, "
                                     f"{row['bytes'][-1] / 2**20:.2f} MiB over the link per step")
            finally:
                for group in groups.values():
                    group.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def run(args: argparse.Namespace) -> list[str]:
    layers = 2 if args.quick else 4
    lines = table_head(("link cap", "layout", "load at start", "step median (s)", "step U=2 x R=2 / U=4",
                        "link MiB/step counted", "link MiB/step arithmetic", "counted / arithmetic"), left=2)
    rows = _measure(args)
    failed = False
    for cap in args.caps:
        step = {label: statistics.median(rows[cap, label]["steps"]) for label in _LAYOUTS}
        for label, (ulysses, ring) in _LAYOUTS.items():
            row = rows[cap, label]
            counted, arithmetic = statistics.median(row["bytes"]), link_bytes(layers, ulysses=ulysses, ring=ring or 1)
            lines.append(table_row([cap, label, f"{statistics.mean(row['load']):.1f}", f"{step[label]:.3f}",
                                    f"{step[_U2R2] / step[_U4]:.2f}" if label == _U2R2 else "",
                                    f"{counted / 2**20:.2f}", f"{arithmetic / 2**20:.2f}",
                                    f"{counted / arithmetic:.3f}"]))
        a, b = (rows[cap, label]["frames"].astype(np.int16) for label in _LAYOUTS)
        diff = int(np.abs(a - b).max())
        failed |= diff > 2 or float(a.std()) < 5
        lines.append(table_row([cap, "frames U=4 vs U=2 x R=2 (max levels)", "", diff, "", "", "", ""]))
    lines += ["", f"gloo between the nodes, one rank on each: {_DUPLEX_BYTES >> 20} MiB sent one way, and each way at "
              "once (a ring step of 2), median of 5", "",
              *table_head(("link cap", "at the cap, one way (s)", "one way (s)", "both ways at once (s)",
                           "both / one way"), left=1)]
    for cap in args.caps:
        pair = rows[cap, _DUPLEX]
        one, both = pair["one way"], pair["both ways at once"]
        lines.append(table_row([cap, f"{_DUPLEX_BYTES * 8 / _rate_bits(cap):.4f}", f"{one:.4f}", f"{both:.4f}",
                                f"{both / one:.2f}"]))
    lines += ["", f"load average at the end (1/5/15 min): {load_average()}"]
    if failed:
        lines.append("CHECK FAILED: the two layouts' videos differ by more than 2 levels, or they are degenerate")
    return lines


def _check_machine() -> str | None:
    if os.geteuid() != 0:
        return "run as root: it makes network namespaces and a veth pair"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers instead of 4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per generation (2 or more)")
    parser.add_argument("--caps", type=lambda s: s.split(","), default=["200mbit", "1gbit", "10gbit"],
                        help="link rates, comma-separated, in tc's units")
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    parser.add_argument("--worker", nargs=2, metavar=("BOX", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        try:
            if args.worker[1] == _DUPLEX:
                _duplex(Path(args.worker[0]))
            else:
                _worker(Path(args.worker[0]), args.worker[1], args.quick)
        except BaseException:
            traceback.print_exc()
            raise
        return 0
    if args.steps < 2:
        parser.error("--steps: give 2 or more (bytes per step are counted between step ends)")
    for cap in args.caps:
        try:
            _rate_bits(cap)
        except ValueError as exc:
            parser.error(str(exc))
    problem = _check_machine()
    if problem:
        print(f"bench/two_nodes.py: {problem}", file=sys.stderr)
        return 2
    import torch

    lines = [f"command: `{command_line(__file__, argv)}`; {os.cpu_count()} CPUs, torch {torch.__version__}; "
             f"load average at the start (1/5/15 min): {load_average()}", "", *run(args)]
    return print_report(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: the fused Ulysses exchange of ``cp_infer.attention`` against the original per-tensor exchange.

Run from the repository root::

    python bench/attention.py [--lengths 1024,2048,...] [--repeats N] [--max-layer-len N] [--out FILE.md]

It prints one markdown table over sequence lengths (batch 1, 16 heads x 64 head dim, fp32, CPU, gloo) at
context-parallel degrees 1 and 2, every number measured in the same run:

- ``exchange fused``: what :func:`cp_infer.ulysses_attention` does around SDPA (pack q/k/v into one buffer,
  one ``all_to_all_single`` through :func:`cp_infer.all_to_all`, unpack; then the same for the output).
  NOTE(isolation): ``ulysses_attention`` does not expose its exchange separately, so the library's own code
  path is timed with SDPA replaced by a stand-in: ``cp_infer.attention.F`` is patched (for the duration of
  the exchange measurement, in that module only) with a proxy of ``torch.nn.functional`` whose
  ``scaled_dot_product_attention`` returns a preallocated dense tensor in the query's dimension order, which
  is the layout real CPU SDPA returns: the output exchange does the same copies it does in the real layer,
  and SDPA's own output allocation is not counted.
- ``exchange original``: the module this project started from (``/work/shared/seed``), rewritten here as the
  baseline: for each of q, k and v, ``torch.chunk`` over heads, ``.contiguous()`` per chunk, a list
  ``dist.all_to_all`` and ``torch.cat`` over the sequence; then the same back for the output (chunk over the
  sequence, cat over heads). Four list all-to-alls per layer. Timed with the same stand-in.
- ``layer``: the full layer, exchange plus real SDPA over the full sequence on the local heads. SDPA is
  quadratic and slow on a few CPU threads, so it is timed only up to ``--max-layer-len`` tokens.

Degree 2 runs on two processes this script spawns (gloo on 127.0.0.1, one intra-op thread each); degree 1
runs in the main process with one thread, where the exchange is the identity and only the layer is timed.
Every measurement warms up first, puts a barrier before each timed iteration, interleaves fused and original
iterations (alternating which goes first), takes the slowest rank's time per iteration and reports the
median. Inputs are random normal. Correctness is checked once per length and the run fails loudly if it does
not hold: fused and original both agree with a single-process reference computed without any exchange, when
SDPA is replaced by the cheap sequence-mixing op ``q + mean_S(v)`` (every length) and with real SDPA (lengths
up to ``--max-layer-len``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import cp_infer.attention as cp_attention  # noqa: E402
from bench.harness import (  # noqa: E402
    command_line,
    free_port,
    load_average,
    print_report,
    progress,
    table_head,
    table_row,
)
from cp_infer import (  # noqa: E402
    ExchangeWorkspace,
    ParallelConfig,
    ParallelState,
    ShardPlan,
    destroy_parallel,
    init_parallel,
    local_attention,
    ulysses_attention,
)

__all__ = ["BenchConfig", "main"]

BATCH = 1
HEADS = 16
HEAD_DIM = 64
DTYPE = torch.float32
DEGREE = 2
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
_LONG_LAYER_LEN = 8192
"""Above this many tokens a full layer takes seconds per call, so the layer is timed fewer times."""
_EXCHANGE_WARMUP = 2
_RATIO_TARGET = 0.5

Sdpa = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class BenchConfig:
    """What to measure."""

    lengths: tuple[int, ...]
    """Sequence lengths in tokens (the whole sequence, before it is split over the ranks)."""
    repeats: int
    """Timed iterations per measurement; the median is reported."""
    max_layer_len: int
    """Longest sequence whose full layer (exchange + real SDPA) is timed."""

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < DEGREE:
            raise ValueError(f"lengths={self.lengths} must be non-empty and each >= {DEGREE} tokens")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} must be >= 1")
        if self.max_layer_len < 0:
            raise ValueError(f"max_layer_len={self.max_layer_len} must be >= 0 (0 skips every layer timing)")

    def layer_repeats(self, length: int) -> int:
        """Fewer timed layers above 8k tokens: SDPA there costs seconds per call on one thread."""
        return self.repeats if length <= _LONG_LAYER_LEN else min(self.repeats, max(3, self.repeats // 2))


# ---------------------------------------------------------------------------------------------------------
# The baseline: the original module's exchange, three chunk/cat all-to-alls in and one out.
# ---------------------------------------------------------------------------------------------------------


def _original_all_to_all(x: torch.Tensor, *, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup):
    n = dist.get_world_size(group)
    send = [chunk.contiguous() for chunk in torch.chunk(x, n, dim=scatter_dim)]
    recv = [torch.empty_like(send[0]) for _ in range(n)]
    dist.all_to_all(recv, send, group=group)
    return torch.cat(recv, dim=gather_dim)


def _original_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: ShardPlan, group: dist.ProcessGroup, sdpa: Sdpa
) -> torch.Tensor:
    # B, S_LOCAL, H, D -> B, S_PAD, H_LOCAL, D (one list all-to-all per tensor)
    q_h, k_h, v_h = (_original_all_to_all(t, scatter_dim=2, gather_dim=1, group=group) for t in (q, k, v))
    k_h, v_h = k_h[:, : plan.orig_len], v_h[:, : plan.orig_len]
    # B, S, H_LOCAL, D -> B, H_LOCAL, S, D (views: SDPA reads the strides)
    out = sdpa(q_h.transpose(1, 2), k_h.transpose(1, 2), v_h.transpose(1, 2)).transpose(1, 2)
    # B, S_PAD, H_LOCAL, D -> B, S_LOCAL, H, D
    return _original_all_to_all(out, scatter_dim=1, gather_dim=2, group=group)


# ---------------------------------------------------------------------------------------------------------
# SDPA stand-ins.
# ---------------------------------------------------------------------------------------------------------


_SDPA_OUT: dict[tuple, torch.Tensor] = {}


def _sdpa_identity(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **_: Any) -> torch.Tensor:
    # NOTE(isolation): real CPU SDPA returns a fresh *dense* tensor in the query's dimension order (checked: for
    # the fused path's token-major query view that is S, B, H, D memory, which at batch 1 is B, S, H, D memory, the
    # original path's). Return a tensor with exactly that layout,
    # allocated once, so the output exchange copies exactly what it copies in the real layer and SDPA's own
    # output allocation is not counted as exchange time. Its values are not used.
    order = sorted(range(query.ndim), key=lambda d: -query.stride(d))
    cache_key = (tuple(query.shape), tuple(order), query.dtype)
    if cache_key not in _SDPA_OUT:
        dense = query.new_empty([query.shape[d] for d in order])
        _SDPA_OUT[cache_key] = dense.permute([order.index(d) for d in range(query.ndim)])
    return _SDPA_OUT[cache_key]


def _sdpa_mix(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **_: Any) -> torch.Tensor:
    # Cheap but needs every token of every local head: a wrong routing of tokens or heads changes the result.
    # B, H_LOCAL, S, D + B, H_LOCAL, 1, D
    return query + value.mean(dim=-2, keepdim=True)


class _FunctionalWithSdpa:
    """``torch.nn.functional`` as ``cp_infer.attention`` sees it, with SDPA swapped for ``sdpa``."""

    def __init__(self, sdpa: Sdpa) -> None:
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, name: str) -> Any:
        return getattr(F, name)


@contextlib.contextmanager
def _library_sdpa(sdpa: Sdpa) -> Iterator[None]:
    """Swap SDPA inside ``cp_infer.attention`` only (this module's own ``F`` is untouched)."""
    with mock.patch.object(cp_attention, "F", _FunctionalWithSdpa(sdpa)):
        yield


# ---------------------------------------------------------------------------------------------------------
# Measurement.
# ---------------------------------------------------------------------------------------------------------


def _inputs(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-sequence q, k, v ``[B, S, H, D]``, identical on every rank (seeded by the length)."""
    gen = torch.Generator().manual_seed(length)
    return tuple(torch.randn(BATCH, length, HEADS, HEAD_DIM, generator=gen, dtype=DTYPE) for _ in range(3))


def _mib_moved(plan: ShardPlan) -> float:
    """Bytes one rank sends per layer: (N-1)/N of its q, k, v shards out and of its output shard back."""
    shard = BATCH * plan.local_len * HEADS * HEAD_DIM * torch.finfo(DTYPE).bits // 8
    return 4 * shard * (plan.world - 1) / plan.world / 2**20


def _time(fns: dict[str, Callable[[], Any]], *, repeats: int, warmup: int, group: dist.ProcessGroup | None):
    """Median milliseconds per fn; each timed iteration starts after a barrier and counts the slowest rank."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    elapsed = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:  # alternate who goes first: no drift bias
            if group is not None:
                dist.barrier(group=group)
            start = time.perf_counter()
            out = fns[name]()
            elapsed[name].append(time.perf_counter() - start)
            del out
    times = torch.tensor([elapsed[name] for name in names], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return {name: statistics.median(times[j].tolist()) * 1e3 for j, name in enumerate(names)}


def _check(name: str, got: torch.Tensor, expected: torch.Tensor, *, length: int, rank: int) -> None:
    # fp32 throughout; the two exchanges only move data, so differences come from summation order in
    # SDPA / mean over strided vs contiguous layouts: a few ulps, far below 1e-5.
    try:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    except AssertionError as err:
        raise AssertionError(f"{name} mismatch at {length} tokens on rank {rank}: {err}") from None


def _bench_degree2(state: ParallelState, config: BenchConfig, length: int) -> dict[str, Any]:
    group, rank = state.cp_group, state.cp_rank
    plan = ShardPlan(orig_len=length, world=state.cp_size)
    q_full, k_full, v_full = _inputs(length)
    q, k, v = (plan.shard(t, rank) for t in (q_full, k_full, v_full))
    # Kept exchange buffers (one workspace reused by every call): the exchange itself, without the page faults of
    # fresh buffers. (The LTX-Video adapter runs without one, trading those page faults for memory.)
    workspace = ExchangeWorkspace()
    fused = lambda: ulysses_attention(q, k, v, plan=plan, group=group, workspace=workspace)
    original = lambda sdpa: _original_attention(q, k, v, plan=plan, group=group, sdpa=sdpa)

    # Routing check with a cheap sequence-mixing stand-in, against a reference built without any exchange.
    # B, S_LOCAL, H, D + B, 1, H, D
    reference = q + v_full.mean(dim=1, keepdim=True)
    with _library_sdpa(_sdpa_mix):
        _check("fused (mix)", fused(), reference, length=length, rank=rank)
    _check("original (mix)", original(_sdpa_mix), reference, length=length, rank=rank)
    del q_full, reference

    with _library_sdpa(_sdpa_identity):
        exchange = _time({"fused": fused, "original": lambda: original(_sdpa_identity)},
                         repeats=config.repeats, warmup=_EXCHANGE_WARMUP, group=group)
    row = {"exchange_fused": exchange["fused"], "exchange_original": exchange["original"],
           "mib": _mib_moved(plan), "checked": "mix"}
    if length <= config.max_layer_len:
        # Single-process reference: this rank's queries over every key, no exchange. The checked calls are
        # the layer's warm-up.
        reference = local_attention(q, k_full, v_full)
        _check("fused (SDPA)", fused(), reference, length=length, rank=rank)
        _check("original (SDPA)", original(F.scaled_dot_product_attention), reference, length=length, rank=rank)
        del reference
        layer = _time({"fused": fused, "original": lambda: original(F.scaled_dot_product_attention)},
                      repeats=config.layer_repeats(length), warmup=0, group=group)
        row.update(layer_fused=layer["fused"], layer_original=layer["original"], checked="mix+sdpa")
    del k_full, v_full
    return row


def _rank_main(rank: int, port: int, config: BenchConfig, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    state = init_parallel(ParallelConfig(ulysses_degree=DEGREE, backend="gloo", device="cpu", timeout_s=900),
                          rank=rank, world_size=DEGREE, local_rank=rank)
    try:
        for length in config.lengths:
            start = time.perf_counter()
            row = _bench_degree2(state, config, length)
            if rank == 0:
                results.put((length, row))
                progress(f"[cp=2] {length} tokens done in {time.perf_counter() - start:.1f} s")
    finally:
        destroy_parallel(state)


def _bench_degree1(config: BenchConfig, length: int) -> dict[str, Any]:
    plan = ShardPlan(orig_len=length, world=1)
    q, k, v = _inputs(length)
    row: dict[str, Any] = {"mib": 0.0, "checked": ""}
    if length <= config.max_layer_len:
        layer = _time({"layer": lambda: ulysses_attention(q, k, v, plan=plan, group=None)},
                      repeats=config.layer_repeats(length), warmup=1, group=None)
        row.update(layer_fused=layer["layer"], layer_original=layer["layer"])
    return row


# ---------------------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------------------

_COLUMNS = ("tokens", "CP", "exchange fused (ms)", "exchange original (ms)", "exchange ratio",
            "layer fused (ms)", "layer original (ms)", "MiB moved / rank", "match")


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _report(config: BenchConfig, rows: dict[tuple[int, int], dict[str, Any]], command: str,
            load_start: str) -> list[str]:
    # NOTE(noise): the timings are wall-clock on shared cores; the load average says how much else ran.
    malloc_env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_"))
    lines = [
        f"command: `{command}`" + (f" (environment: `{malloc_env}`)" if malloc_env else ""),
        "",
        f"torch {torch.__version__}, gloo on 127.0.0.1, {os.cpu_count()} CPU cores; 1 intra-op thread per process "
        f"(degree 1: the main process; degree 2: 2 spawned ranks, torch.get_num_threads()={torch.get_num_threads()} "
        f"here); batch {BATCH}, {HEADS} heads x {HEAD_DIM} head dim, {str(DTYPE).removeprefix('torch.')}; "
        f"load average (1/5/15 min) at start {load_start}, at end {load_average()}.",
        "",
        *table_head(_COLUMNS, left=0),
    ]
    ratios = {}
    for length in config.lengths:
        for degree in (1, DEGREE):
            row = rows[(length, degree)]
            ratio = None
            if degree > 1:
                ratio = ratios[length] = row["exchange_fused"] / row["exchange_original"]
            cells = [
                str(length), str(degree), _fmt(row.get("exchange_fused")), _fmt(row.get("exchange_original")),
                _fmt(ratio), _fmt(row.get("layer_fused")), _fmt(row.get("layer_original")), _fmt(row["mib"], ".1f"),
                {"": "", "mix": "✓ (mix)", "mix+sdpa": "✓"}[row["checked"]],
            ]
            lines.append(table_row(cells))
    long_layers = [n for n in config.lengths if _LONG_LAYER_LEN < n <= config.max_layer_len]
    long_note = (f"; layers above {_LONG_LAYER_LEN} tokens: {config.layer_repeats(max(long_layers))} iterations"
                 if long_layers else "")
    worst = max(ratios, key=ratios.get)
    met = all(r <= _RATIO_TARGET for r in ratios.values())
    lines += [
        "",
        f"- Median of {config.repeats} timed iterations (after {_EXCHANGE_WARMUP} warm-up iterations for the "
        f"exchange, 1 for the layer{long_note}); "
        "a barrier precedes each iteration and each iteration counts the slowest rank.",
        "- exchange = the layer with SDPA replaced by a stand-in returning a preallocated tensor in real CPU "
        "SDPA's output layout, so only pack + all-to-all + unpack, both ways, is timed. fused: "
        "`cp_infer.ulysses_attention` (2 `all_to_all_single`); original: per-tensor "
        "chunk/contiguous/`dist.all_to_all`/cat (4 list all-to-alls).",
        f"- layer = exchange + real SDPA over the full sequence on the local heads; `-` beyond "
        f"--max-layer-len={config.max_layer_len} tokens (SDPA is quadratic: on one thread a call takes ~10 s "
        "at 16k tokens and ~40 s at 32k per rank). Degree 1: no exchange (0 collectives), one SDPA over all "
        "heads in the main process: the single-process baseline, measured once and shown in both layer columns.",
        "- MiB moved / rank: bytes each rank sends per layer, (N-1)/N of its q, k, v shards out and of its "
        "output shard back; the same for both methods.",
        "- match: ✓ = on every rank, fused and original both agree (allclose, rtol=atol=1e-5) with a "
        "single-process reference computed without any exchange, under real SDPA (`cp_infer.local_attention` "
        "of the rank's queries over all keys) and under the cheap sequence-mixing stand-in `q + mean_S(v)`; "
        "✓ (mix) = the stand-in check only (SDPA not run at that length). A mismatch aborts the run.",
        f"- exchange ratio (fused / original) at CP={DEGREE}: worst {ratios[worst]:.2f} at {worst} tokens; "
        f"target <= {_RATIO_TARGET} at every length: {'met' if met else 'NOT met'}.",
    ]
    return lines


def _parse_lengths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths {text!r} must be comma-separated integers, "
                                         "e.g. 1024,2048") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=_parse_lengths, default=DEFAULT_LENGTHS,
                        help="comma-separated sequence lengths in tokens (default: 1k to 32k)")
    parser.add_argument("--repeats", type=int, default=7, help="timed iterations per measurement (default: 7)")
    parser.add_argument("--max-layer-len", type=int, default=8192,
                        help="longest sequence whose full layer with real SDPA is timed (default: 8192)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    try:
        config = BenchConfig(lengths=args.lengths, repeats=args.repeats, max_layer_len=args.max_layer_len)
    except ValueError as err:
        parser.error(str(err))
    command = command_line(__file__, argv)

    load_start = load_average()
    torch.set_num_threads(1)
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for length in config.lengths:
        start = time.perf_counter()
        rows[(length, 1)] = _bench_degree1(config, length)
        progress(f"[cp=1] {length} tokens done in {time.perf_counter() - start:.1f} s")

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(_rank_main, args=(free_port(), config, results), nprocs=DEGREE, join=True)
    while not results.empty():
        length, row = results.get()
        rows[(length, DEGREE)] = row

    return print_report(_report(config, rows, command, load_start), args.out)


if __name__ == "__main__":
    sys.exit(main())

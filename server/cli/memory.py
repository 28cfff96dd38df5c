"""``cp-infer memory``: where a model's weights would go on each rank, from its config files alone, so a deployment
can be sized before it exists.

Invariants:
- No weight is read: every component is built on the meta device from its config (``models.common.placement``), so a
  folder of configs without weights is enough (``bench/configs/`` holds such folders at released sizes).
- The numbers are the plan's (``cp_infer.placement.plan_memory``), the same arithmetic ``--weights auto`` decides by
  and what a loaded rank then holds (FSDP2's rows of each shard, to the byte). Rank 0 holds the most of every shard,
  so its row is the one printed. Activations are not in the plan.
- A bad flag, model or layout exits 2 in one line; nothing else is started (no process group, no torchrun).
"""

from __future__ import annotations

import argparse

from cp_infer.placement import MemoryPlan, format_bytes, plan_memory
from models.families import default_model_name, titles_text

__all__ = ["add_memory_parser", "plan_text", "run_memory"]

_GIB = 2**30


def add_memory_parser(commands) -> None:
    from server.cli.common import add_placement_arguments

    parser = commands.add_parser(
        "memory", help="print where a model's weights would go on each rank (configs only, no weights read)",
        description="Print, from the model's config files alone, each component's parameters and bytes, and what each "
                    "rank of the group would hold of it with --weights and --offload: on the device at rest, on the "
                    "CPU, and gathered or streamed in while it runs. Activations are not included.")
    parser.add_argument("--model", default=None, help=f"a diffusers-format {titles_text()} folder (its configs are "
                                                      "enough), a hub id, or an embedded default")
    parser.add_argument("--nproc", type=int, default=1, metavar="N", help="ranks of the group (default 1)")
    parser.add_argument("--guidance-degree", type=int, default=None, metavar="G")
    parser.add_argument("--ulysses-degree", type=int, default=None, metavar="U",
                        help="with --guidance-degree: the replica group is G x R x U ranks, which the sharded "
                             "weights are spread over (default: all N)")
    parser.add_argument("--ring-degree", type=int, default=None, metavar="R",
                        help="Ulysses groups round a ring (default 1)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    add_placement_arguments(parser)
    parser.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                        help="each GPU's free memory in GiB: says whether the weights fit and what --weights auto "
                             "picks (without it, auto is replicated, as on the CPU)")


def run_memory(args: argparse.Namespace, _argv: list[str]) -> int:
    from cp_infer.mesh import MeshLayout
    from models.common.loading import resolve_files
    from models.common.placement import AUTO_FRACTION, auto_shards, model_components

    if args.device_memory is not None and not args.device_memory > 0:
        raise ValueError(f"--device-memory {args.device_memory}: give each GPU's free memory in GiB, e.g. 24")
    layout = MeshLayout.resolve(args.nproc, guidance_degree=args.guidance_degree, ulysses_degree=args.ulysses_degree,
                                ring_degree=args.ring_degree)
    files = resolve_files(args.model, weights=False)
    components = model_components(files.folder, dtype=args.dtype)
    ranks = layout.replica_size
    replicated = plan_memory(components, ranks=ranks, sharded=False, offload=args.offload)
    free = None if args.device_memory is None else args.device_memory * _GIB
    weights = args.weights
    if weights == "auto":
        weights = "sharded" if free is not None and ranks > 1 and auto_shards(replicated.peak_device_bytes, free) \
            else "replicated"
    plan = plan_memory(components, ranks=ranks, sharded=weights == "sharded", offload=args.offload)
    print(plan_text(plan, model=args.model or default_model_name(), dtype=args.dtype, layout=layout,
                    asked=args.weights, resolved=weights))
    if free is not None:
        need = plan.peak_device_bytes
        verdict = "fits" if need <= AUTO_FRACTION * free else "does not fit"
        print(f"on {args.device_memory:g} GiB per GPU: {verdict} ({format_bytes(need)} of weights at the peak, "
              f"{need / free:.0%} of it; --weights auto shards past {AUTO_FRACTION:.0%}, leaving the rest to the "
              "activations)")
    return 0


def plan_text(plan: MemoryPlan, *, model: str, dtype: str, layout, asked: str, resolved: str) -> str:
    """The table ``cp-infer memory`` prints."""
    replicas = f", {layout.replicas} replica groups" if layout.replicas > 1 else ""
    weights = resolved if asked == resolved else f"{asked} -> {resolved}"
    ring = f" x ring {layout.ring}" if layout.ring > 1 else ""
    lines = [f"{model}: {dtype}, {layout.world} rank(s) (guidance {layout.guidance}{ring} x Ulysses {layout.ulysses}"
             f"{replicas}), weights {weights}, offload {','.join(plan.offload) or 'none'}",
             "",
             f"{'component':<17}{'params':>10}{'whole':>12}{'device':>12}{'CPU':>12}{'running':>12}  per rank: where"]
    for c in plan.components:
        lines.append(f"{c.name:<17}{_count(c.params):>10}{format_bytes(c.nbytes):>12}"
                     f"{format_bytes(c.device_bytes):>12}{format_bytes(c.host_bytes):>12}"
                     f"{'+' + format_bytes(c.transient_bytes) if c.transient_bytes else '-':>12}  {c.where}")
    params = sum(c.params for c in plan.components)
    lines.append(f"{'total':<17}{_count(params):>10}{format_bytes(plan.replicated_bytes):>12}"
                 f"{format_bytes(plan.device_bytes):>12}{format_bytes(plan.host_bytes):>12}")
    lines += ["", f"per rank (rank 0 holds the most): {format_bytes(plan.device_bytes)} on the device at rest, "
                  f"{format_bytes(plan.peak_device_bytes)} at the peak (the largest 'running' added), "
                  f"{format_bytes(plan.host_bytes)} on the CPU; activations come on top"]
    return "\n".join(lines)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


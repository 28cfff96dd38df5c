"""A model, not a measurement: which mesh layout to pick on 8 GPUs, per model and resolution.

    python bench/layout_model.py [--gpus 8] [--ring] [--out FILE.md]

Pure arithmetic from the costs a step is made of (no GPU was lent to this project's sessions; the constants below
are an H200 node's published figures with stated efficiencies, and the shape of the model is the one
``bench/layout.py`` measures on 2 CPU ranks: passes per guidance rank x per-pass compute over the Ulysses shard +
two all-to-alls per self-attention layer + one exchange of predictions per step):

- per pass (one transformer forward over ``S`` video tokens, width ``D``, ``L`` blocks, ``T`` text tokens):
  ``L x (24 S D^2 + 4 S^2 D + 4 S T D)`` FLOPs (the self-attention's four projections and its scores and values,
  the cross-attention's query and output projections and its scores, a 4x feed-forward); over ``U`` Ulysses ranks
  each rank does ``1/U`` of it, the attention by ``ceil(H / U)`` heads (padded heads cost as real ones);
- Ulysses exchange: per self-attention layer, the fused query/key/value all-to-all and the output's, ``4 S D / U``
  bf16 values per rank of which ``(U - 1) / U`` leave it, at the all-to-all bandwidth, plus a latency per
  all-to-all; the cross-attention needs none (its keys are the text's, on every rank);
- ring (``R`` Ulysses groups, ``--ring-degree``; with ``--ring`` only, which also adds Wan 2.1 1.3B's 12 heads):
  the sequence over ``U x R`` ranks, so each rank's compute is
  ``1/(U x R)`` of the pass's, the heads padded to a multiple of ``U`` only, the all-to-alls carry ``1/R`` of the
  values; per self-attention layer ``R - 1`` point-to-point steps each pass a key/value block (``2 S D / (U R)``
  bf16 values) to the next ring rank, overlapped with the attention of the block held, so a step costs the longer
  of its transfer (+ a latency) and that block's attention. An upper bound on what the ring gains: perfect overlap,
  the split attention at the same efficiency as the whole, the fp32 merge of blocks free;
- guidance: a step's ``P`` passes shared over ``G`` ranks, ``ceil(P / G)`` on the busiest; one all-gather of the
  predictions (``P x S x 128`` fp32 latent values) per step when ``G > 1``;
- replicas ``gpus / (G x R x U)`` run separate jobs: latency is the step time x steps, throughput ``R`` / latency.

Every rank holds the whole transformer (bf16) and text encoder, which fit an H200's 141 GB for every model listed,
so memory does not restrict the layouts here. The decode, text encode and start-up are per job and left out.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.harness import command_line, print_report, table_row  # noqa: E402 -- path set-up

__all__ = ["Hardware", "ModelShape", "step_seconds", "main"]


@dataclass(frozen=True)
class Hardware:
    name: str = "H200 SXM, NVLink 4"
    flops: float = 989e12
    """Dense bf16 peak, FLOP/s."""
    mfu: float = 0.5
    """Fraction of the peak a transformer block reaches (large matmuls and flash attention)."""
    a2a_bytes_per_s: float = 300e9
    """All-to-all bandwidth per GPU within the node (about 2/3 of NVLink 4's 450 GB/s one way)."""
    a2a_latency_s: float = 25e-6
    """Fixed cost of one all-to-all (launch and synchronisation)."""


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    heads: int
    head_dim: int
    passes: int
    """Transformer passes per step with the reference pipeline's default guidance."""
    text_tokens: int
    steps: int
    """The reference pipeline's default steps."""

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


# WanPipeline: CFG (2 passes), 50 steps, 512 umT5 tokens; 12 heads, which 8 ranks of Ulysses pad to 16 (--ring only).
WAN_1_3B = ModelShape("Wan 2.1 1.3B", layers=30, heads=12, head_dim=128, passes=2, text_tokens=512, steps=50)
MODELS = (
    # LTXPipeline: CFG (2 passes), 50 steps, 128 T5 tokens.
    ModelShape("LTX-Video 2B (0.9.x)", layers=28, heads=32, head_dim=64, passes=2, text_tokens=128, steps=50),
    ModelShape("LTX-Video 13B (0.9.7)", layers=48, heads=32, head_dim=128, passes=2, text_tokens=128, steps=50),
    # LTX2Pipeline's defaults: CFG's pair, STG and modality isolation; 40 steps; 1024 Gemma tokens. The audio stream
    # (a narrower transformer over ~25 tokens a second) is small beside the video's and left out.
    ModelShape("LTX-2 19B (video stream)", layers=48, heads=32, head_dim=128, passes=4, text_tokens=1024, steps=40),
)
RESOLUTIONS = ((704, 480, 161), (768, 512, 121), (1216, 704, 257), (1920, 1088, 121))


def tokens(width: int, height: int, frames: int) -> int:
    """Latent tokens of the video: the VAE's 32 x 32 spatial and 8x temporal compression (first frame alone)."""
    return ((frames - 1) // 8 + 1) * (height // 32) * (width // 32)


def step_seconds(model: ModelShape, s: int, guidance: int, ulysses: int, hw: Hardware, ring: int = 1) -> float:
    d, layers, t = model.width, model.layers, model.text_tokens
    ranks = ulysses * ring
    head_pad = math.ceil(model.heads / ulysses) * ulysses / model.heads
    linear = 24 * s * d * d + 4 * s * t * d
    attention = 4 * s * s * d * head_pad
    speed = hw.flops * hw.mfu
    compute = layers * (linear + attention) / ranks / speed
    exchange = 0.0
    if ulysses > 1:
        values = 4 * s * d / ranks * (ulysses - 1) / ulysses
        exchange = layers * (2 * values / hw.a2a_bytes_per_s + 2 * hw.a2a_latency_s)
    if ring > 1:  # R - 1 block transfers, each hidden behind one block's attention where it is shorter
        transfer = 2 * (2 * s * d / ranks) / hw.a2a_bytes_per_s + hw.a2a_latency_s
        block_attention = attention / ranks / ring / speed
        exchange += layers * (ring - 1) * max(0.0, transfer - block_attention)
    per_pass = compute + exchange
    gather = 0.0
    if guidance > 1:
        gather = model.passes * s * 128 * 4 / hw.a2a_bytes_per_s + hw.a2a_latency_s
    return math.ceil(model.passes / guidance) * per_pass + gather


def layouts(gpus: int, ring: bool = False) -> list[tuple[int, int, int, int]]:
    """``(replicas, guidance, ulysses, ring)`` over ``gpus`` (ring degree 1 unless ``ring``)."""
    rings = range(1, gpus + 1) if ring else (1,)
    return [(gpus // (g * u * r), g, u, r) for g in range(1, gpus + 1) for u in range(1, gpus + 1)
            for r in rings if gpus % (g * u * r) == 0]


def table(gpus: int, hw: Hardware, ring: bool = False) -> list[str]:
    lines = [table_row(("model", "video", "tokens", "fastest job: layout", "its latency (s)", "vs U=8 alone",
                        "most jobs/hour: layout", "jobs/hour", "vs fastest layout's")),
             "|---|---|---:|---|---:|---:|---|---:|---:|"]
    for model in ((WAN_1_3B, *MODELS) if ring else MODELS):
        for width, height, frames in RESOLUTIONS:
            s = tokens(width, height, frames)
            scored = []
            for replicas, g, u, r in layouts(gpus, ring):
                latency = model.steps * step_seconds(model, s, g, u, hw, ring=r)
                scored.append((latency, 3600 * replicas / latency, replicas, g, u, r))
            fastest = min(scored)
            busiest = max(scored, key=lambda x: (x[1], -x[0]))
            ulysses_only = next(x for x in scored if x[2:] == (1, 1, gpus, 1))

            def name(x) -> str:
                ring = f" x R={x[5]}" if x[5] > 1 else ""
                return (f"{x[2]} x " if x[2] > 1 else "") + f"G={x[3]}{ring} x U={x[4]}"

            lines.append(table_row([model.name, f"{width}x{height}x{frames}", s, name(fastest), f"{fastest[0]:.1f}",
                                    f"{fastest[0] / ulysses_only[0]:.2f}x", name(busiest), f"{busiest[1]:.0f}",
                                    f"{busiest[1] / fastest[1]:.2f}x"]))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ring", action="store_true", help="also the layouts with a ring axis (and Wan 2.1 1.3B)")
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    hw = Hardware()
    command = command_line(__file__, argv)
    lines = [f"command: `{command}`; a model of {args.gpus} x {hw.name}: {hw.flops / 1e12:.0f} TFLOP/s bf16 at "
             f"{hw.mfu:.0%} of peak, all-to-all {hw.a2a_bytes_per_s / 1e9:.0f} GB/s per GPU + "
             f"{hw.a2a_latency_s * 1e6:.0f} us each; the reference pipelines' default steps and guidance passes",
             "", *table(args.gpus, hw, args.ring)]
    return print_report(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

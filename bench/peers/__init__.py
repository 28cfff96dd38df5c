"""diffusers' side of the benchmarks: what a diffusers user runs, against which ours is measured.

- :mod:`bench.peers.diffusers_cp`: diffusers' own context parallelism (``enable_parallelism``, Ulysses) made to run on
  CPU/gloo, and runners that call ``LTXPipeline``, ``LTXConditionPipeline`` and ``LTX2Pipeline`` as shipped (the
  in-process benchmarks load them in their rank processes);
- the ``torchrun`` scripts the whole-process benchmarks start by path, one per ``cp-infer`` command they are the peer
  of: :data:`GENERATE` (``cp-infer generate``, in ``bench/cli.py``), :data:`BATCH` (``cp-infer batch``) and
  :data:`SERVE` (``cp-infer serve``, both in ``bench/serve_batch.py``).

Importing this package imports nothing else.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BATCH", "GENERATE", "SERVE"]

_HERE = Path(__file__).resolve().parent
GENERATE = _HERE / "generate.py"
BATCH = _HERE / "batch.py"
SERVE = _HERE / "serve.py"

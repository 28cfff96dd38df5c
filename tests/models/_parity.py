"""What "N ranks equal 1 rank" means for a family's parity tests whose runs return ``[(frames, latents), ...]`` per
request on every rank (frames ``None`` off the delivering rank)."""

from __future__ import annotations

import numpy as np
import torch


def assert_ranks_close(expected, results, *, world, seed, exact=False) -> None:
    """``results`` (every rank's runs) against ``expected`` (1 rank's): only rank 0 delivers; frames within 1 uint8
    level (mean under 0.01) and latents within 1e-4, or bit for bit with ``exact``."""
    assert all(r is None for rank in results[1:] for r, _ in rank), "only the delivering rank returns frames"
    for (exp, exp_latents), (got, got_latents) in zip(expected, results[0], strict=True):
        assert got.shape == exp.shape
        diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
        if exact:
            assert diff.max() == 0, f"world={world} seed={seed} shape={exp.shape}: max {diff.max()}"
            np.testing.assert_array_equal(got_latents, exp_latents)
            continue
        assert diff.max() <= 1 and diff.mean() < 0.01, \
            f"world={world} seed={seed} shape={exp.shape}: max {diff.max()} mean {diff.mean()}"
        torch.testing.assert_close(torch.from_numpy(got_latents), torch.from_numpy(exp_latents), rtol=0, atol=1e-4)

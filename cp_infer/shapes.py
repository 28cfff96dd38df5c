"""Video <-> latent shape arithmetic for causal video VAEs (e.g. 8x temporal, 32x spatial).

Every check raises a ``ValueError`` that names the bad value and the nearest valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VideoGeometry", "LatentShape"]


@dataclass(frozen=True)
class LatentShape:
    frames: int
    height: int
    width: int

    @property
    def tokens(self) -> int:
        return self.frames * self.height * self.width


def _nearest_multiples(value: int, step: int, offset: int = 0, minimum: int = 1) -> list[int]:
    """The valid values ``step * k + offset`` (>= minimum) just below and above ``value``."""
    below = (value - offset) // step * step + offset
    candidates = {below, below + step}
    return sorted(c for c in candidates if c >= minimum)


@dataclass(frozen=True)
class VideoGeometry:
    """The compression of a causal video VAE plus the transformer's patch size."""

    temporal_compression: int = 8
    spatial_compression: int = 32
    patch_size: int = 1
    patch_size_t: int = 1
    min_latent_side: int = 1
    """Smallest latent height/width the VAE decodes (2 when its convs pad by reflection)."""

    def __post_init__(self) -> None:
        for name in ("temporal_compression", "spatial_compression", "patch_size", "patch_size_t", "min_latent_side"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def spatial_step(self) -> int:
        return self.spatial_compression * self.patch_size

    def check_frames(self, frames: int, *, field: str = "num_frames") -> None:
        t = self.temporal_compression
        if frames < 1 or (frames - 1) % t != 0:
            near = ", ".join(str(c) for c in _nearest_multiples(max(frames, 1), t, offset=1))
            raise ValueError(f"{field}={frames} is not {t}k+1 (the VAE compresses time {t}x, keeping the first "
                             f"frame); try {near}")

    def check_side(self, value: int, *, field: str) -> None:
        step = self.spatial_step
        smallest = step * self.min_latent_side
        if value < smallest or value % step != 0:
            near = ", ".join(str(c) for c in _nearest_multiples(max(value, smallest), step, minimum=smallest))
            what = f"a multiple of {step} of at least {smallest}" if smallest > step else \
                f"a positive multiple of {step}"
            raise ValueError(f"{field}={value} is not {what}; try {near}")

    def latent_shape(self, frames: int, height: int, width: int) -> LatentShape:
        """Check a video shape and return its latent (token grid) shape."""
        self.check_frames(frames)
        self.check_side(height, field="height")
        self.check_side(width, field="width")
        latent_frames = (frames - 1) // self.temporal_compression + 1
        if latent_frames % self.patch_size_t:
            raise ValueError(f"num_frames={frames} gives {latent_frames} latent frames, not a multiple of "
                             f"patch_size_t={self.patch_size_t}")
        return LatentShape(
            frames=latent_frames // self.patch_size_t,
            height=height // self.spatial_step,
            width=width // self.spatial_step,
        )

    def video_frames(self, latent_frames: int) -> int:
        return (latent_frames - 1) * self.temporal_compression + 1

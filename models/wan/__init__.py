"""Wan (`WanPipeline`, `WanImageToVideoPipeline`): its options, loading, parallel plan, VAE decode, windows and
embedded default."""

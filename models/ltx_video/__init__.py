"""LTX-Video (`LTXConditionPipeline`, `LTXPipeline`): its options, adapter, stages, windows and embedded default."""

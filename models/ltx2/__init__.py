"""LTX-2 (`LTX2Pipeline`): its options, adapter, conditions, soundtrack, stages, windows and embedded default."""

"""What the model families share: loading from folders, hub ids and single files; the window arithmetic and the
two-stage plan; the LTX VAEs' time-parallel decode; adapters; placement and sharding; tokenizers; the embedded-model
builder. Nothing here imports a family package."""

"""The model runner: a scheduled step in, sampled tokens out. Persistent input batch, sampler,
checkpoint loading, the speculative draft model, CUDA graphs, warm-up, memory sizing and the
tensor-parallel ranks."""

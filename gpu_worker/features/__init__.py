"""Optional capabilities the runner plugs in: LoRA, quantization, speculative decoding, beam
search and structured output. Each depends on core, models and kernels only."""

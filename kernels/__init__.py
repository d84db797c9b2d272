"""pagoda's paged-KV kernels: Triton on CUDA, plain torch everywhere else.

Not to be confused with the Hugging Face `kernels` package that transformers probes for;
tests/test_kernels_name.py checks that transformers does not mistake this one for it.
"""

"""Model implementations: the native Llama family (llama.py over parallel.py's sharded layers
and attention.py's paged attention), any other transformers decoder on the same paged pool
(transformers_backend.py), and the registry by architecture (registry.py)."""

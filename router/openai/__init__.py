"""The router's OpenAI-compatible HTTP front: /v1/models, /v1/completions, /v1/chat/completions,
vLLM's /tokenize, /detokenize and LoRA admin, on the router's own event loop.

A request body becomes a GenerateRequest (request.py), is tokenized and length-checked, then goes
through Pipeline.generate (generation.py): the same routing decision, retries and upstream gRPC
stream as the gRPC front. Worker deltas become an OpenAI response or chunks (response.py), sent
whole or as server-sent events (sse.py). Errors are OpenAI error objects; a gRPC status maps to
its HTTP status and the `field:` prefix of pagoda's messages names the `param`. front.py wires
the routes (OpenAIFront, which the router process starts when it serves HTTP).
"""

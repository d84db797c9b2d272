"""pagoda: LLM serving for internal services, installed as one namespace.

The parts live in the repository's top-level folders; this package links them under one name so
that nothing but `pagoda` goes to the top of site-packages (each bare name is another project on
PyPI, and `kernels` is Hugging Face's, which transformers requires):

    pagoda.protos      contracts: the gRPC API, the block-hash chain, the Redis schema, limits
    pagoda.runtime     what every process shares: start-up, lifetime, TLS and keys, tokenizer
    pagoda.kernels     Triton kernels for CUDA, C kernels for CPU, and their torch references
    pagoda.gpu_worker  one worker: engine core, runner, models, features, serving
    pagoda.router      one router: index, scoring, proxy, the gRPC and OpenAI fronts
    pagoda.clients     the Python client and the `pagoda` CLI

Importing `pagoda` imports none of them: a router never loads torch.
"""

"""Which build of a Triton kernel runs a launch: compiled for CUDA tensors, interpreted for CPU ones.

Triton decides at decoration time (TRITON_INTERPRET) whether @triton.jit compiles or interprets,
for the whole process. The CPU twins of the GPU tests must run under the interpreter even on a
CUDA host, beside the compiled GPU tests, so every launcher asks `for_tensor(kernel, x)`: CUDA
tensors get the compiled kernel, anything else an interpreted twin built from the same source.

The interpreter runs a kernel's body as Python, where a compiled JITFunction cannot be called:
the @triton.jit helpers it reaches (its own module's, and triton.language's tl.sum, tl.max, ...)
are swapped for interpreted twins while a twin runs, as TRITON_INTERPRET=1 would have built them.
That swap is process-wide for the launch, like the interpreter's own patching of triton.language,
so a compiled kernel must not be compiled in another thread meanwhile (only tests run twins).
"""
from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


def for_tensor(kernel, x: torch.Tensor):
    """The kernel to launch on x's device: kernel itself on CUDA, its interpreted twin elsewhere."""
    if x.is_cuda or isinstance(kernel, InterpretedFunction):
        return kernel
    return interpreted(kernel)


@functools.lru_cache(maxsize=None)
def interpreted(kernel: JITFunction) -> InterpretedFunction:
    return _Twin(kernel.fn)


@functools.lru_cache(maxsize=None)
def _helper(fn) -> InterpretedFunction:
    return InterpretedFunction(fn)


class _Twin(InterpretedFunction):
    """An interpreted kernel that swaps in interpreted jit helpers for the length of a launch."""

    def run(self, *args, grid, warmup, **kwargs):
        modules = [sys.modules[self.fn.__module__], tl, tl.core, tl.standard, tl.math]
        saved = [(m, name, value) for m in modules for name, value in vars(m).items()
                 if isinstance(value, JITFunction)]
        interpret = triton.knobs.runtime.interpret
        try:
            # Code that triton imports lazily during a launch checks the knob, not the env.
            triton.knobs.runtime.interpret = True
            for module, name, value in saved:
                setattr(module, name, _helper(value.fn))
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        finally:
            triton.knobs.runtime.interpret = interpret
            for module, name, value in saved:
                setattr(module, name, value)

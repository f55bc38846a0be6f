"""Gradient trees with the leaf shapes of real models."""

from __future__ import annotations

import math

import torch

__all__ = ["gpt_shapes", "make_grads", "make_params", "numel"]


def gpt_shapes(dim: int, layers: int, vocab: int, context: int) -> list[tuple[str, tuple[int, ...]]]:
    """GPT-2 parameter shapes: 12 leaves per block (LayerNorms, fused QKV, MLP, biases) + 4.

    ``gpt_shapes(1024, 12, 50257, 1024)`` is 148 leaves and 203.6 M elements.
    """
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte", (vocab, dim)), ("wpe", (context, dim))]
    for i in range(layers):
        p = f"h.{i}."
        shapes += [
            (p + "ln_1.weight", (dim,)),
            (p + "ln_1.bias", (dim,)),
            (p + "attn.c_attn.weight", (3 * dim, dim)),
            (p + "attn.c_attn.bias", (3 * dim,)),
            (p + "attn.c_proj.weight", (dim, dim)),
            (p + "attn.c_proj.bias", (dim,)),
            (p + "ln_2.weight", (dim,)),
            (p + "ln_2.bias", (dim,)),
            (p + "mlp.c_fc.weight", (4 * dim, dim)),
            (p + "mlp.c_fc.bias", (4 * dim,)),
            (p + "mlp.c_proj.weight", (dim, 4 * dim)),
            (p + "mlp.c_proj.bias", (dim,)),
        ]
    return [*shapes, ("ln_f.weight", (dim,)), ("ln_f.bias", (dim,))]


def make_grads(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Gradients of the given shapes, uniform in [-1, 1) (cheaper to draw than normals)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.empty(s, dtype=dtype).uniform_(-1.0, 1.0, generator=g) for s in shapes]


def make_params(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters carrying ``grads`` as ``.grad``, for the in-place APIs.

    Their data is ``torch.empty``: never written, so on Linux its pages are
    never touched and cost no memory.
    """
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty(g.shape, dtype=g.dtype))
        p.grad = g
        params.append(p)
    return params


def numel(shapes: list[tuple[int, ...]]) -> int:
    """Total number of elements."""
    return sum(math.prod(s) for s in shapes)

"""Gradient trees with the leaf shapes of real models."""

from __future__ import annotations

import math

import torch

__all__ = ["gpt_shapes", "llama3_8b_shapes", "make_grads", "make_params", "numel"]


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


def llama3_8b_shapes(layers: int = 32, scale: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-3-8B parameter shapes (torchtitan names): 9 leaves per block + 3.

    Dim 4096, 32 heads of 128 with 8 KV heads, SwiGLU hidden 14336, vocab
    128256 (https://huggingface.co/meta-llama/Meta-Llama-3-8B, config.json):
    291 leaves and 8.03 G elements. ``scale`` divides every width (a small
    stand-in with the same leaf structure, for smoke tests).
    """
    dim, kv, hidden, vocab = 4096 // scale, 1024 // scale, 14336 // scale, 128256 // scale
    shapes: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (vocab, dim))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [
            (p + "attention_norm.weight", (dim,)),
            (p + "attention.wq.weight", (dim, dim)),
            (p + "attention.wk.weight", (kv, dim)),
            (p + "attention.wv.weight", (kv, dim)),
            (p + "attention.wo.weight", (dim, dim)),
            (p + "ffn_norm.weight", (dim,)),
            (p + "feed_forward.w1.weight", (hidden, dim)),
            (p + "feed_forward.w2.weight", (dim, hidden)),
            (p + "feed_forward.w3.weight", (hidden, dim)),
        ]
    return [*shapes, ("norm.weight", (dim,)), ("output.weight", (vocab, dim))]


def make_grads(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int = 0, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Gradients of the given shapes, uniform in [-1, 1) (cheaper to draw than normals)."""
    g = torch.Generator(device).manual_seed(seed)
    return [torch.empty(s, dtype=dtype, device=device).uniform_(-1.0, 1.0, generator=g) for s in shapes]


def make_params(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters carrying ``grads`` as ``.grad``, for the in-place APIs.

    Their data is ``torch.empty``: never written, so on Linux its pages are
    never touched and cost no memory.
    """
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty(g.shape, dtype=g.dtype, device=g.device))
        p.grad = g
        params.append(p)
    return params


def numel(shapes: list[tuple[int, ...]]) -> int:
    """Total number of elements."""
    return sum(math.prod(s) for s in shapes)

"""The one model of the demo, the tests and the benchmarks: a small llama-like transformer.

Its layout follows torchtitan's, so parameter names, placements and stages
are the ones a real trainer hands to the clip: ``tok_embeddings`` →
``layers`` (a ``ModuleDict`` keyed by the global layer id, so a pipeline
stage keeps the names it had in the whole model) → ``norm`` → ``output``.
A block is pre-norm causal self-attention and a feed-forward, dense
(SwiGLU) or a small top-1 mixture of experts.

:func:`build_model` builds the whole model from a seed alone, so every rank
and a single-process reference hold the same weights; :func:`split_stage`
keeps what one pipeline stage owns. How the model is parallelized is in
:mod:`demo.parallel`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# torch 2.13 renamed funcol's *_tensor collectives *_single (same arguments); torch 2.11 and 2.12 have only
# the old names, and 2.13 and 2.14 keep them as deprecated aliases.
_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter_autograd = (
    getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
)

__all__ = [
    "Attention",
    "Block",
    "FeedForward",
    "GroupedExperts",
    "MoE",
    "ModelConfig",
    "RMSNorm",
    "Transformer",
    "build_model",
    "loss_fn",
    "random_batch",
    "split_stage",
    "token_batches",
]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the transformer; the defaults are the demo's."""

    vocab: int = 128
    dim: int = 64
    n_heads: int = 4
    n_layers: int = 2
    hidden: int = 128
    seq_len: int = 32
    moe_layers: tuple[int, ...] = ()  # layers whose feed-forward is a mixture of experts
    n_experts: int = 4
    tie_embeddings: bool = False  # the output head starts as the input embedding's weight


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, written out so that DTensor inputs need no special kernel."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head self-attention; the head count follows the (TP-local) width of ``wq``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """``n_experts`` MLPs stored as 3-D weights (expert dim first), as in torchtitan.

    Under expert parallelism (:func:`demo.parallel.apply_ep`) the weights are
    DTensors sharded on the expert dim over ``ep_mesh``; tokens are
    all-gathered over that mesh, each rank runs its own experts on the tokens
    routed to them, and a reduce-scatter returns every token's output to its
    rank (an all-gather/reduce-scatter token dispatcher).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(cfg.n_experts, cfg.dim, cfg.hidden) * cfg.dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(cfg.n_experts, cfg.hidden, cfg.dim) * cfg.hidden**-0.5)
        self.ep_mesh: DeviceMesh | None = None

    def forward(self, tokens: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1, self.w2
        if isinstance(w1, DTensor):
            w1, w2 = w1.to_local(), w2.to_local()
        first = 0
        if self.ep_mesh is not None:
            group = self.ep_mesh.get_group()
            first = self.ep_mesh.get_local_rank() * w1.shape[0]
            tokens = _gather_autograd(tokens, 0, group)
            expert = _gather(expert, 0, group)
        out = torch.zeros_like(tokens)
        for e in range(w1.shape[0]):
            routed = (expert == first + e).unsqueeze(-1).to(tokens.dtype)
            out = out + routed * (F.silu(tokens @ w1[e]) @ w2[e])
        if self.ep_mesh is not None:
            out = _reduce_scatter_autograd(out, "sum", 0, self.ep_mesh.get_group())
        return out


class MoE(nn.Module):
    """Top-1 routing over :class:`GroupedExperts`; the router is a dense layer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        score, expert = self.router(tokens).softmax(-1).max(-1)
        return self.experts(tokens * score.unsqueeze(-1), expert).reshape(x.shape)


class Block(nn.Module):
    """Pre-norm residual block: attention, then the feed-forward (dense or MoE)."""

    def __init__(self, cfg: ModelConfig, moe: bool = False) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = MoE(cfg) if moe else FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only transformer. A pipeline stage is this module with the parts it lacks set to ``None``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i in cfg.moe_layers) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.dim)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def build_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """The whole model, initialized from ``seed`` alone (every rank and the reference build the same one)."""
    torch.manual_seed(seed)
    return Transformer(cfg)


def split_stage(model: Transformer, stage: int, n_stages: int, *, layers: Sequence[int] | None = None) -> Transformer:
    """Keeps pipeline stage ``stage``'s share of ``model``, in place, and returns it.

    The first stage also keeps the input embedding, the last the final norm
    and output head. ``layers`` are the stage's layer ids (default: an even
    split in order, the earlier stages taking fewer where it is uneven).
    """
    if layers is None:
        n = len(model.layers)
        if n < n_stages:
            raise ValueError(f"{n} layers cannot be split over {n_stages} pipeline stages")
        bounds = [round(i * n / n_stages) for i in range(n_stages + 1)]
        layers = range(bounds[stage], bounds[stage + 1])
    keep = {str(i) for i in layers}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < n_stages - 1:
        model.norm = None
        model.output = None
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (in float32 whatever the logits' dtype)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def token_batches(cfg: ModelConfig, batch: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A synthetic token stream with learnable structure, cut into ``(inputs, targets)`` per step.

    The stream is a random sparse Markov chain: each token is followed by
    one of four tokens fixed per token, so the loss has something to learn.
    """
    g = torch.Generator().manual_seed(10_000 + seed)
    successors = torch.randint(0, cfg.vocab, (cfg.vocab, 4), generator=g)
    n = steps * batch * (cfg.seq_len + 1)
    stream = torch.empty(n, dtype=torch.long)
    stream[0] = 0
    choice = torch.randint(0, 4, (n,), generator=g)
    for i in range(1, n):
        stream[i] = successors[stream[i - 1], choice[i]]
    seqs = stream.view(steps, batch, cfg.seq_len + 1)
    return [(s[:, :-1].clone(), s[:, 1:].clone()) for s in seqs]


def random_batch(cfg: ModelConfig, dp_rank: int, size: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random tokens and next-token labels for one data-parallel rank (the same on its TP/PP peers)."""
    g = torch.Generator().manual_seed(1000 * seed + dp_rank)
    tokens = torch.randint(0, cfg.vocab, (size, cfg.seq_len + 1), generator=g)
    # Contiguous copies: torch 2.11's pipeline stages check an input's strides against a contiguous one's.
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()

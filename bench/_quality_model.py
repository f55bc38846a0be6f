"""The quality study's corpus and model: byte tokens of the standard library's own source, a small GPT.

The corpus is read from the running interpreter's installation
(``sysconfig.get_paths()["stdlib"]``, its top-level ``*.py`` files, sorted
by name), so every machine with the same Python has the same bytes; its
size and SHA-256 are recorded with each result. Every tenth file (sorted
index 0, 10, 20, ...) is held out, whole, so no held-out window shares a file
with a training window.

The model is a pre-LayerNorm decoder-only transformer written with torch
only: learned token and position embeddings, ``layers`` blocks of causal
multi-head attention (``F.scaled_dot_product_attention``) and a GELU MLP of
four times the width, a final LayerNorm and an untied output head over the
256 byte values. Weights start as GPT-2's: normal(0, 0.02), the residual
projections scaled by ``1 / sqrt(2 * layers)``, biases zero.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import pathlib
import sys
import sysconfig

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Corpus", "ModelConfig", "TinyGPT", "load_corpus"]

VOCAB = 256  # byte tokens


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    layers: int = 4
    width: int = 128
    heads: int = 4
    context: int = 128


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8, the training files one after the other
    heldout: torch.Tensor  # uint8, the held-out files
    meta: dict


def load_corpus() -> Corpus:
    """The standard library's top-level modules as bytes, split by file; ``meta`` says what was read."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise RuntimeError(f"no *.py files in {root}: this interpreter has no standard-library sources")
    train, heldout = [], []
    digest = hashlib.sha256()
    for i, path in enumerate(files):
        data = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + data)
        (heldout if i % 10 == 0 else train).append(data)
    train_bytes, heldout_bytes = b"\n".join(train), b"\n".join(heldout)
    meta = {
        "source": str(root),
        "python": sys.version.split()[0],
        "files": len(files),
        "heldout_files": len(heldout),
        "bytes": sum(len(d) for d in train) + sum(len(d) for d in heldout),
        "train_bytes": len(train_bytes),
        "heldout_bytes": len(heldout_bytes),
        "sha256": digest.hexdigest(),
        "split": "sorted by file name; every tenth file (index 0, 10, ...) held out, whole",
    }
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train_bytes), as_tensor(heldout_bytes), meta)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A byte-level decoder-only transformer; ``forward(tokens) -> logits``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(VOCAB, cfg.width)
        self.pos = nn.Parameter(torch.zeros(cfg.context, cfg.width))
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, VOCAB, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 1 and "ln" in name:
                continue  # LayerNorm: ones and zeros
            if name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))

    def loss(self, window: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats) of ``window`` (batch, context + 1), uint8 or int64."""
        window = window.long()
        logits = self.forward(window[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), window[:, 1:].reshape(-1))


def windows(stream: torch.Tensor, starts: torch.Tensor, context: int) -> torch.Tensor:
    """The windows of ``context + 1`` bytes of ``stream`` starting at ``starts``, stacked."""
    return torch.stack([stream[s : s + context + 1] for s in starts.tolist()])

"""A small GPT-style decoder built in code, and a synthetic language to
train it on (no downloads): the model of the main job and of bench/train.py.

The data is drawn from a fixed random Markov chain over the vocabulary, so a
model can learn it: the loss falls from ln(vocab) toward the chain's entropy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 512
    dim: int = 256
    layers: int = 4
    heads: int = 4
    seq: int = 64

    @classmethod
    def about_30m(cls):
        # 8192*512 tied embedding + 8 blocks of 12*512^2: about 30M parameters
        return cls(vocab=8192, dim=512, layers=8, heads=8, seq=128)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        # q, k and v apart (not one packed Linear), so a tensor-parallel
        # plan splits each by heads (zero.parallel.parallelize_gpt)
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        # -1 heads: under tensor parallelism a rank computes its own heads
        q, k, v = (z(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for z in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers) if "down" in name
                                else 0.02)

    def forward(self, ids, labels=None):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


class MarkovText:
    """Token sequences from a fixed random Markov chain with a few likely
    successors per token."""

    def __init__(self, vocab: int, seq: int, seed: int = 0, branching: int = 4):
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.seq = vocab, seq
        self.successors = torch.randint(0, vocab, (vocab, branching), generator=g)

    def batch(self, size: int, step: int, rank: int = 0):
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        ids = torch.empty(size, self.seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, self.vocab, (size,), generator=g)
        choice = torch.randint(0, self.successors.shape[1], (size, self.seq), generator=g)
        for t in range(self.seq):
            ids[:, t + 1] = self.successors[ids[:, t], choice[:, t]]
        return ids[:, :-1], ids[:, 1:]

"""TinyNet, a small model with every parameter kind (a convolution included), its batches and loss."""

import torch
from torch import nn


class TinyNet(nn.Module):
    """Embedding, hidden matrices of two shapes (two share a shape), a conv kernel, norms, a head."""

    def __init__(self, vocab=23, d=12, tied=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 3 * d)
        self.down = nn.Linear(3 * d, d, bias=False)
        self.conv = nn.Conv1d(d, d, kernel_size=3, padding=1, bias=False)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        h = self.embed_tokens(ids)
        h = h + self.k(torch.tanh(self.q(h)))
        h = h + self.down(torch.relu(self.up(h)))
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.lm_head(self.norm(h))


def make_model(dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    return TinyNet(**kw).to(dtype)


def batches(n, vocab=23, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (3, 7), generator=g) for _ in range(n)]


def loss_fn(model, ids):
    logits = model(ids)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def train(model, opt, bs):
    """One optimizer step per batch of ``bs``."""
    for ids in bs:
        opt.zero_grad()
        loss_fn(model, ids).backward()
        opt.step()

"""How far each routing of torchtitan's fused ``wqkv`` is from the unfused model's update (issue 57).

``python benchmarks/torchtitan_wqkv.py`` (needs torchtitan; ``.ci/torchtitan.sh`` says what it imports).

torchtitan's ``FusedQKVLinear`` stores each KV group's q heads, then its k and v rows (``(n_kv, heads_per_kv + 2,
head_dim)``). The unfused model (its ``QKVLinear``) updates ``wq``, ``wk``, ``wv`` as three matrices; no row view
of ``wqkv`` gives them, so meqmuon can keep it whole or split it per KV group into ``(q, k, v)`` runs. For
torchtitan's llama3 and qwen3 debug models (two layers; causal SDPA for FlexAttention, which has no CPU
backward), after 3 training updates, the update of layer 0's ``wqkv`` by one step (``lr=1``, no weight decay,
float32 Newton-Schulz) under each routing is compared with the unfused one: relative distance, cosine and
norm ratio. Deterministic: no timing, any CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import meqmuon


class _SDPA(nn.Module):
    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, scale=scale, enable_gqa=enable_gqa).transpose(1, 2)


def _model(model: str) -> nn.Module:
    from torchtitan.models.llama3 import model_registry as llama3
    from torchtitan.models.qwen3 import model_registry as qwen3

    cfg = {"llama3": llama3, "qwen3": qwen3}[model]("debugmodel").model
    cfg.layers = cfg.layers[:2]
    torch.manual_seed(0)
    m = cfg.build()
    m.init_states()
    for block in m.layers.values():
        block.attention.inner_attention = _SDPA()
    return m


def _train(m: nn.Module, name: str, steps: int = 3) -> None:
    """``steps`` forward/backward passes on random tokens, stepping all but the last: ``m`` holds its gradients."""
    gen = torch.Generator().manual_seed(1)
    opt = meqmuon.build_optimizer(name, m, lr=2e-2, ns_dtype=torch.float32)
    vocab = m.tok_embeddings.weight.shape[0]
    for s in range(steps):
        ids = torch.randint(0, vocab, (4, 65), generator=gen)
        opt.zero_grad()
        F.cross_entropy(m(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
        if s < steps - 1:
            opt.step()


def _update(w: torch.Tensor, g: torch.Tensor, split: tuple[int, ...] | None, name: str) -> torch.Tensor:
    p = nn.Parameter(w.clone())
    p.grad = g.clone()
    group = {"params": [p], "kind": "hidden", "names": ["w"], "views": ["matrix"], "splits": [split]}
    meqmuon.build_optimizer(name, [group], lr=1.0, weight_decay=0.0, ns_dtype=torch.float32).step()
    return w - p.detach()


def main() -> None:
    torch.set_num_threads(1)
    print("| model | optimizer | n_kv x (q, k, v rows) | routing | distance to unfused | cosine | norm ratio |")
    print("|---|---|---|---|---:|---:|---:|")
    for model in ("llama3", "qwen3"):
        for name in ("meqmuon", "muon"):
            m = _model(model)
            _train(m, name)
            qkv = m.layers["0"].attention.qkv_linear
            w, g = qkv.wqkv.weight.detach(), qkv.wqkv.weight.grad.detach()
            hd, r = qkv.head_dim, qkv.heads_per_kv
            n_kv = w.shape[0] // ((r + 2) * hd)
            rows = torch.arange(w.shape[0]).view(n_kv, r + 2, hd)
            unfused = torch.zeros_like(w)
            for block in (rows[:, :r].reshape(-1), rows[:, r].reshape(-1), rows[:, r + 1].reshape(-1)):
                unfused[block] = _update(w[block], g[block], None, name)
            for routing, split in (("whole", None), ("per KV group", (r * hd, hd, hd) * n_kv)):
                d = _update(w, g, split, name)
                dist = ((d - unfused).norm() / unfused.norm()).item()
                cos = (d.flatten() @ unfused.flatten() / d.norm() / unfused.norm()).item()
                print(f"| {model} debugmodel | {name} | {n_kv} x ({r * hd}, {hd}, {hd}) | {routing} | {dist:.3f} | "
                      f"{cos:.3f} | {(d.norm() / unfused.norm()).item():.3f} |")


if __name__ == "__main__":
    main()

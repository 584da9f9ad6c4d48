"""Parameter shapes of the paper's Llama models, by kind, without allocating a model.

Llama configs from GaLore ``configs/llama_{60m,130m,350m}.json`` (baselines.md section 5a): untied
embedding and LM head, SwiGLU MLP, no biases, RMSNorm gains per layer (2) plus a final one.
"""

from __future__ import annotations

LLAMA = {
    "llama-60m": dict(layers=8, hidden=512, ffn=1376, vocab=32000),
    "llama-130m": dict(layers=12, hidden=768, ffn=2048, vocab=32000),
    "llama-350m": dict(layers=24, hidden=1024, ffn=2736, vocab=32000),
}


def llama_shapes(name: str) -> dict[str, list[tuple[int, ...]]]:
    """``kind -> [shape]`` for Llama model ``name`` (one of ``LLAMA``), in model order."""
    c = LLAMA[name]
    d, f, v = c["hidden"], c["ffn"], c["vocab"]
    hidden: list[tuple[int, ...]] = []
    vector: list[tuple[int, ...]] = []
    for _ in range(c["layers"]):
        hidden += [(d, d)] * 4  # q, k, v, o
        hidden += [(f, d), (f, d), (d, f)]  # gate, up, down
        vector += [(d,), (d,)]  # input and post-attention RMSNorm
    vector.append((d,))  # final norm
    return {"hidden": hidden, "embedding": [(v, d)], "head": [(v, d)], "vector": vector}

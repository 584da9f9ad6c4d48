"""Token-weighted validation loss over the fixed validation set (design notes, convention 9).

The loss is the sum of per-token cross-entropies over every validation target divided by the number
of targets, not a mean of per-batch means (GaLore's ``evaluate_model`` averages batch means with an
off-by-one counter; with equal-length packed rows both agree only when the last batch is full).
In DDP the rows are split across ranks (rank ``r`` takes rows ``r, r + W, ...``) and the sums are
all-reduced, so every rank returns the same numbers.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meqmuon.train.data import split_batch

__all__ = ["causal_lm_loss", "evaluate"]


def causal_lm_loss(model: torch.nn.Module, batch: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of a packed batch ``(B, L + 1)``: inputs ``batch[:, :-1]``, targets ``batch[:, 1:]``.

    The logits are upcast to fp32 before the softmax (they come out of bf16 autocast in bf16).
    """
    inputs, targets = split_batch(batch)
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    val: torch.Tensor,
    *,
    batch_size: int,
    device: torch.device | str = "cpu",
    autocast: contextlib.AbstractContextManager | None = None,
    val_bytes: int | None = None,
) -> dict[str, Any]:
    """``{"val_loss", "val_ppl", "val_bpb", "val_tokens"}`` of ``model`` on ``val`` (int64 ``(n, L + 1)``).

    ``val_bpb`` (bits per UTF-8 byte) is ``loss * targets / (val_bytes * ln 2)``; None without ``val_bytes``.
    The model is put in eval mode and restored to its previous mode afterwards.
    """
    was_training = model.training
    model.eval()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    rows = val[rank::world]
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses, targets)
    for i in range(0, rows.shape[0], batch_size):
        batch = rows[i : i + batch_size].to(device, non_blocking=True)
        with autocast if autocast is not None else contextlib.nullcontext():
            loss_sum = causal_lm_loss(model, batch, reduction="sum")
        total[0] += loss_sum.double()
        total[1] += batch.shape[0] * (batch.shape[1] - 1)
    if world > 1:
        dist.all_reduce(total)
    model.train(was_training)
    loss = (total[0] / total[1]).item()
    n_targets = int(total[1].item())
    bpb = loss * n_targets / (val_bytes * math.log(2)) if val_bytes else None
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_bpb": bpb, "val_tokens": n_targets}

"""Token-weighted validation loss over the fixed validation set (design notes, convention 9).

The loss is the sum of per-token cross-entropies over every validation target divided by the number
of targets, not a mean of per-batch means (GaLore's ``evaluate_model`` averages batch means with an
off-by-one counter; with equal-length packed rows both agree only when the last batch is full).
In DDP the rows are split across ranks (rank ``r`` takes rows ``r, r + W, ...``) and the sums are
all-reduced, so every rank returns the same numbers. Under ``--fsdp`` / ``--tp`` the rows are split over
the data-parallel coordinate (a tensor-parallel group evaluates the same rows together), and every rank
runs the same number of forward passes (a rank out of rows repeats a batch and counts none of it),
since the sharded model's forward is itself a collective.
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
    shard: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """``{"val_loss", "val_ppl", "val_bpb", "val_tokens"}`` of ``model`` on ``val`` (int64 ``(n, L + 1)``).

    ``val_bpb`` (bits per UTF-8 byte) is ``loss * targets / (val_bytes * ln 2)``; None without ``val_bytes``.
    The model is put in eval mode and restored to its previous mode afterwards. ``shard``: ``(dp_rank,
    dp_size)`` of a sharded model (see the module docstring); else the rows follow the process group.
    """
    was_training = model.training
    model.eval()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank, parts = shard if shard is not None else ((dist.get_rank(), world) if world > 1 else (0, 1))
    rows = val[rank::parts]
    # A sharded forward is a collective: every rank runs as many as the rank with the most rows.
    n = math.ceil(math.ceil(val.shape[0] / parts) / batch_size) * batch_size if shard is not None else rows.shape[0]
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses, targets)
    for i in range(0, n, batch_size):
        batch = rows[i : i + batch_size]
        counted = batch.shape[0] > 0
        batch = (batch if counted else val[:batch_size]).to(device, non_blocking=True)
        with autocast if autocast is not None else contextlib.nullcontext():
            loss_sum = causal_lm_loss(model, batch, reduction="sum")
        if counted:
            total[0] += loss_sum.double()
            total[1] += batch.shape[0] * (batch.shape[1] - 1)
    if shard is not None and world > 1:  # each TP group's sums once: divide out the tp copies
        total /= world // parts
    if world > 1:
        dist.all_reduce(total)
    model.train(was_training)
    loss = (total[0] / total[1]).item()
    n_targets = round(total[1].item())
    bpb = loss * n_targets / (val_bytes * math.log(2)) if val_bytes else None
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_bpb": bpb, "val_tokens": n_targets}

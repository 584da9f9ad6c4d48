"""MeqMuon as a drop-in optimizer for the HF Trainer: ``Trainer(optimizers=(opt, sched))``.

Proves the optimizer object the user built is the one that steps (selection counters advance once
per update), that the scheduler drives its lr, and that the loss falls on a learnable toy task.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import meqmuon


class RepeatingTokens(torch.utils.data.Dataset):
    """Sequences that repeat a short random pattern: learnable within a few steps."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i % 4)
        ids = torch.randint(0, 32, (4,), generator=g).repeat(4)
        return {"input_ids": ids, "labels": ids}


def test_meqmuon_in_hf_trainer(tmp_path):
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    opt = meqmuon.MeqMuon(meqmuon.param_groups(model), lr=5e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=16,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=RepeatingTokens(), optimizers=(opt, sched))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 16 and losses[-1] < 0.6 * losses[0]
    counts = opt.selection_counts()
    assert len(counts) == 14 and all(r + c == 16 for r, c in counts.values())
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-2 / 2.6)

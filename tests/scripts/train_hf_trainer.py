"""A tiny ``transformers.Trainer.train()`` run (tests/integration/test_frameworks.py).

A small MLP with dropout whose ``forward`` returns the loss, 56 samples in batches of 8 (7 per
epoch), ``gradient_accumulation_steps=2`` (4 optimizer steps per epoch, the last one on one
batch), AdamW with linear warmup and decay, logging every step, the user's own
``save_steps=5`` checkpoints in ``OUT_DIR``. Prints every log entry (loss, learning rate, grad
norm, epoch) and the final train loss; saves the final weights:

    python train_hf_trainer.py OUT.pt OUT_DIR [EPOCHS]
    torchrun --nproc-per-node 2 train_hf_trainer.py OUT.pt OUT_DIR [EPOCHS]  # DDP, gloo
"""

import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback, TrainingArguments


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))

    def forward(self, x, labels):
        return {"loss": F.cross_entropy(self.body(x), labels)}


class Rows(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class PrintLogs(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        keep = {k: logs[k] for k in ("loss", "learning_rate", "grad_norm", "epoch") if k in logs}
        if keep and state.is_world_process_zero:
            print(f"log step {state.global_step} {json.dumps(keep, sort_keys=True)}")


def main():
    out, out_dir = sys.argv[1], sys.argv[2]
    epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    torch.manual_seed(0)
    data = Rows(torch.randn(56, 8), torch.randint(0, 3, (56,)))
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        num_train_epochs=epochs, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2,
        logging_steps=1, save_strategy="steps", save_steps=5, report_to="none",
        disable_tqdm=True, seed=0, use_cpu=True, remove_unused_columns=False,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    trainer = Trainer(model=Net(), args=args, train_dataset=data, callbacks=[PrintLogs()])
    result = trainer.train()
    if trainer.is_world_process_zero():
        torch.save(trainer.model.state_dict(), out)
        print(f"FINAL train_loss {result.training_loss!r} step {result.global_step}")


if __name__ == "__main__":
    main()

"""A tiny ``lightning.Trainer.fit(model, loader)`` run (tests/integration/test_frameworks.py).

A small MLP with dropout, 48 samples in batches of 8 (6 batches per epoch, shuffled), SGD with
momentum and a per-step ``StepLR``, a validation loop twice per epoch (``val_check_interval=0.5``:
after batches 3 and 6), and the user's own ``ModelCheckpoint`` callbacks in ``CKPT_DIR`` (every
5 steps, and the best 2 by ``val_loss``). Prints every step's loss and learning rate and every
validation's loss; saves the final weights:

    python train_lightning.py OUT.pt CKPT_DIR [EPOCHS]
    torchrun --nproc-per-node 2 train_lightning.py OUT.pt CKPT_DIR [EPOCHS]  # DDP, gloo
"""

import os
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
        self.val_losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.body(x), y)
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        if self.trainer.is_global_zero:
            print(f"log step {self.global_step} epoch {self.current_epoch} batch {batch_idx} "
                  f"loss {loss.item()!r} lr {lr!r}")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.body(x), y)
        self.val_losses.append(loss)
        return loss

    def on_validation_epoch_end(self):
        val = torch.stack(self.val_losses).mean()
        self.val_losses.clear()
        self.log("val_loss", val, sync_dist=True)
        if not self.trainer.sanity_checking and self.trainer.is_global_zero:
            print(f"log val step {self.global_step} loss {val.item()!r}")

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    out, ckpt_dir = sys.argv[1], sys.argv[2]
    epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    L.seed_everything(0, verbose=False)
    train = DataLoader(TensorDataset(torch.randn(48, 8), torch.randint(0, 3, (48,))),
                       batch_size=8, shuffle=True)
    val = DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 3, (16,))), batch_size=8)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="every-{step}", every_n_train_steps=5,
                                 save_top_k=-1),
                 ModelCheckpoint(dirpath=ckpt_dir, filename="best-{step}", monitor="val_loss",
                                 save_top_k=2)]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ddp = {"devices": world, "strategy": DDPStrategy(process_group_backend="gloo")} \
        if world > 1 else {"devices": 1}
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, **ddp,
                        enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True, val_check_interval=0.5, callbacks=callbacks)
    trainer.fit(Net(), train, val)
    if not trainer.is_global_zero:
        return
    torch.save(trainer.lightning_module.state_dict(), out)
    print(f"FINAL step {trainer.global_step} best {callbacks[1].best_model_path} "
          f"{callbacks[1].best_model_score.item()!r}")


if __name__ == "__main__":
    main()

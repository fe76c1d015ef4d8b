"""Train a small MLP on scikit-learn's digits with a Lightning ``Trainer``.

A ``LightningModule`` and ``Trainer.fit``, the way the Lightning docs write them. It knows
nothing about cfrun:

    python examples/lightning_train.py --out pl.pt
    cfrun --interval 10 examples/lightning_train.py --out pl.pt
"""

import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if batch_idx % 10 == 9:
            print(f"epoch {self.current_epoch} batch {batch_idx + 1} step {self.global_step} "
                  f"loss {loss.item():.6f}")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default="pl.pt")
    args = p.parse_args()

    L.seed_everything(0, verbose=False)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    loader = DataLoader(TensorDataset(x[:1400], y[:1400]), batch_size=32, shuffle=True,
                        drop_last=True)
    model = Classifier()
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1,
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    trainer.fit(model, loader)
    torch.save(model.state_dict(), args.out)
    print(f"FINAL step {trainer.global_step}")


if __name__ == "__main__":
    main()

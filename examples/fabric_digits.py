"""MNIST-style training with Lightning Fabric under DDP, on scikit-learn's digits.

The shape of Lightning's Fabric MNIST example: ``fabric.setup`` / ``fabric.setup_dataloaders``,
``fabric.backward``, and ``for batch_idx, (data, target) in enumerate(train_loader)``. Run it on
2 CPU ranks (gloo) with torchrun, or under cfrun; it knows nothing about cfrun:

    torchrun --nproc-per-node 2 examples/fabric_digits.py --out fabric.pt
    cfrun --nproc-per-node 2 --interval 5 examples/fabric_digits.py --out fabric.pt
"""

import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = self.drop(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--out", default="fabric.pt")
    args = p.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(1)
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    train_loader = DataLoader(TensorDataset(x[:1400], y[:1400]), batch_size=32, shuffle=True)
    test_loader = DataLoader(TensorDataset(x[1400:], y[1400:]), batch_size=64)
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)

    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

    for epoch in range(1, args.epochs + 1):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            fabric.backward(loss)
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                fabric.print(f"Train Epoch: {epoch} [{batch_idx}/{len(train_loader)}] "
                             f"Loss: {loss.item():.6f}")
        scheduler.step()

        model.eval()
        test_loss, correct = 0.0, 0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += (output.argmax(dim=1) == target).sum().item()
        test_loss = fabric.all_reduce(test_loss, reduce_op="sum")
        correct = fabric.all_reduce(correct, reduce_op="sum")
        fabric.print(f"Test set: Average loss: {test_loss / 397:.4f}, "
                     f"Accuracy: {int(correct)}/397")

    if fabric.global_rank == 0:
        torch.save(model.module.state_dict() if hasattr(model, "module") else model.state_dict(),
                   args.out)
    fabric.print("FINAL done")


if __name__ == "__main__":
    main()

"""Train a small CNN on scikit-learn's handwritten digits (8x8 images, 10 classes).

A plain PyTorch script, written the way people write them. It knows nothing about cfrun:

    python examples/digits_train.py --epochs 8
    cfrun --interval 20 examples/digits_train.py --epochs 8
"""

import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset


class Digits(Dataset):
    def __init__(self, images, labels, augment=False):
        self.images = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        self.labels = torch.tensor(labels, dtype=torch.long)
        self.augment = augment

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i]
        if self.augment:
            # random shift by up to one pixel, plus a little noise
            dx, dy = torch.randint(-1, 2, (2,)).tolist()
            x = torch.roll(x, shifts=(dy, dx), dims=(1, 2))
            x = x + 0.05 * torch.randn_like(x)
        return x, self.labels[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(self.drop(torch.flatten(x, 1)))


def evaluate(model, loader):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            total += y.numel()
    return loss_sum / total, correct / total


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="digits_model.pt")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.set_num_threads(1)

    digits = load_digits()
    perm = np.random.permutation(len(digits.target))
    val_idx, train_idx = perm[:300], perm[300:]
    train_set = Digits(digits.images[train_idx], digits.target[train_idx], augment=True)
    val_set = Digits(digits.images[val_idx], digits.target[val_idx])
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=100)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)

    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        running_loss, seen = 0.0, 0
        for step, (x, y) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            running_loss += loss.item() * y.numel()
            seen += y.numel()
        scheduler.step()
        val_loss, val_acc = evaluate(model, val_loader)
        best_acc = max(best_acc, val_acc)
        print(f"epoch {epoch + 1}/{args.epochs} train_loss {running_loss / seen:.6f} "
              f"val_loss {val_loss:.6f} val_acc {val_acc:.4f} best {best_acc:.4f} "
              f"lr {scheduler.get_last_lr()[0]:.5f} steps {step + 1}", flush=True)

    torch.save(model.state_dict(), args.out)
    print(f"final val_acc {val_acc:.4f} best {best_acc:.4f} saved {args.out}")


if __name__ == "__main__":
    main()

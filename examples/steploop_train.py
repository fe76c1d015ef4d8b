"""A tiny character-level language model trained with a step loop (nanoGPT style).

No DataLoader: batches come from the global torch RNG, progress lives in plain variables
(``iter_num``, ``best_val_loss``, the prefetched batch ``X, Y``) and the learning rate follows a
hand-written warmup + cosine schedule. The text is the source of Python's own ``argparse``
module. It knows nothing about cfrun:

    python examples/steploop_train.py --max-iters 300
    cfrun --interval 25 examples/steploop_train.py --max-iters 300
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--max-iters", type=int, default=300)
parser.add_argument("--block", type=int, default=16)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--eval-interval", type=int, default=50)
parser.add_argument("--seed", type=int, default=1337)
parser.add_argument("--out", default="steploop_model.pt")
args = parser.parse_args()

torch.manual_seed(args.seed)
torch.set_num_threads(1)

with open(argparse.__file__, "rb") as f:
    data = torch.tensor(list(f.read()), dtype=torch.long)
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]


def get_batch(split):
    d = train_data if split == "train" else val_data
    ix = torch.randint(len(d) - args.block - 1, (args.batch_size,))
    x = torch.stack([d[i:i + args.block] for i in ix])
    y = d[ix + args.block]
    return x, y


class CharMLP(nn.Module):
    def __init__(self, block, dim=48, hidden=256):
        super().__init__()
        self.emb = nn.Embedding(256, dim)
        self.net = nn.Sequential(nn.Linear(block * dim, hidden), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, 256))

    def forward(self, x):
        return self.net(self.emb(x).flatten(1))


@torch.no_grad()
def estimate_loss(model, iters=10):
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.zeros(iters)
        for k in range(iters):
            x, y = get_batch(split)
            losses[k] = F.cross_entropy(model(x), y).item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it, warmup=30):
    if it < warmup:
        return args.lr * (it + 1) / warmup
    progress = (it - warmup) / max(1, args.max_iters - warmup)
    return 0.1 * args.lr + 0.45 * args.lr * (1 + math.cos(math.pi * min(progress, 1.0)))


def main():
    model = CharMLP(args.block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    iter_num = 0
    best_val_loss = float("inf")
    X, Y = get_batch("train")  # prefetch the first batch
    while True:
        lr = get_lr(iter_num)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % args.eval_interval == 0:
            losses = estimate_loss(model)
            best_val_loss = min(best_val_loss, losses["val"])
            print(f"iter {iter_num}: train {losses['train']:.6f} val {losses['val']:.6f} "
                  f"best {best_val_loss:.6f} lr {lr:.6f}", flush=True)
        loss = F.cross_entropy(model(X), Y)
        X, Y = get_batch("train")  # prefetch the next batch while the step runs
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num > args.max_iters:
            break
    torch.save(model.state_dict(), args.out)
    print(f"final loss {loss.item():.6f} best_val {best_val_loss:.6f} saved {args.out}")


main()

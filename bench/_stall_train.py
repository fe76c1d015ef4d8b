"""Training script timed by ``bench/stall_parts.py`` (not meant to be run by hand).

A GPT's layout at a toy width: 24 pre-norm blocks (two LayerNorms, four Linear layers each), an
embedding, a position table and a head, AdamW: 294 parameters and ~600 optimizer tensors, the
tensor count of a real GPT-2-medium-sized model, with little compute, so that what a
checkpoint costs per tensor at its boundary shows. argv: steps. Knows nothing about cfrun.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.proj(self.qkv(self.ln1(x))[..., :x.shape[-1]])
        return x + self.out(torch.relu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, dim=32, layers=24, vocab=100, seq=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[:idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def train_step(model, opt, gen):
    idx = torch.randint(0, 100, (8, 17), generator=gen)
    loss = F.cross_entropy(model(idx[:, :-1]).reshape(-1, 100), idx[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _step in range(int(sys.argv[1])):
        train_step(model, opt, gen)


if __name__ == "__main__":
    main()

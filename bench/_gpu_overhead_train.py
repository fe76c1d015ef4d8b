"""Training script timed by ``bench/gpu_overhead.py`` (not meant to be run by hand).

A plain PyTorch script that knows nothing about cfrun. ``--model``:

* ``gpt``: a decoder-only transformer (``--size full``: 24 layers x 1024, 16 heads, sequence
  1024, batch 8, vocabulary 32000, bf16 autocast; ``small``: 2 layers x 128, sequence 64, batch
  4, vocabulary 512, fp32), AdamW;
* ``mlp``: two square linear layers sized so that parameters and Adam state take
  ``--state-mb`` (``bench/deferred_stall.py``: a large state whose persist outlasts a step);
* ``resnet``: a ResNet-50-like conv net written here (bottleneck blocks 3-4-6-3 with
  BatchNorm: ~320 parameters and buffers, ~640 tensors with the optimizer's momentum; ``full``:
  widths 64..2048, 224x224 images, batch 128, channels-last, bf16 autocast; ``small``: widths
  divided by 16, 16x16 images, batch 4, fp32), SGD with momentum.

``--contenders NAME:KIND:K[:STEPS],...`` runs each in-script contender in turn in this one
process, each for STEPS (``--steps``) iterations on the same model (the same work): ``none`` (no checkpoint; also
what runs under ``cfrun``), ``torch_save`` (+ fsync, synchronously) or ``dcp_thread``
(``torch.distributed.checkpoint.async_save``) every K steps, with ``_overhead_train``'s
``Checkpointer`` (at most one DCP save in flight). After each it prints ``RESULT {json}``:
``iter_ms`` (every iteration after ``WARMUP_ITERS``, host time between loop-body starts; the
step ends with ``loss.item()``, so device work is inside), ``stall_s`` and ``pgt_s`` per
checkpoint, ``state_bytes``.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _overhead_train import WARMUP_ITERS, Checkpointer  # noqa: E402

parser = argparse.ArgumentParser(description="GPU overhead training script")
parser.add_argument("--model", choices=["gpt", "resnet", "mlp"], default="gpt")
parser.add_argument("--state-mb", type=float, default=1500.0,
                    help="mlp: megabytes of parameters + Adam state (two square layers)")
parser.add_argument("--size", choices=["full", "small"], default="small")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--contenders", default="none:none:0")
parser.add_argument("--ckpt-dir", default=None)

GPT = {"full": dict(layers=24, dim=1024, heads=16, seq=1024, batch=8, vocab=32000),
       "small": dict(layers=2, dim=128, heads=4, seq=64, batch=4, vocab=512)}
RESNET = {"full": dict(width=64, image=224, batch=128, classes=1000),
          "small": dict(width=4, image=16, batch=4, classes=10)}


class Block(nn.Module):
    """A pre-norm transformer block (causal self-attention, 4x MLP)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPTModel(nn.Module):
    def __init__(self, layers, dim, heads, seq, vocab, **_):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, stride):
        super().__init__()
        cout = 4 * mid
        self.c1, self.b1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.c2, self.b2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.c3, self.b3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        y = self.b3(self.c3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-50's layout (bottlenecks 3-4-6-3) at base width ``width``."""

    def __init__(self, width, classes, **_):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], width
        for i, n in enumerate((3, 4, 6, 3)):
            mid = width * 2 ** i
            for j in range(n):
                layers.append(Bottleneck(cin, mid, 2 if j == 0 and i > 0 else 1))
                cin = 4 * mid
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def build(model, size, device, state_mb=1500.0):
    """(model, optimizer, batch function, autocast dtype or None) for ``model`` at ``size``."""
    gpu = device.type == "cuda"
    if model == "mlp":  # 2 h^2 fp32 weights, Adam twice that again: 24 h^2 bytes
        h = int((state_mb * 1e6 / 24) ** 0.5)
        net = nn.Sequential(nn.Linear(h, h, bias=False), nn.Tanh(),
                            nn.Linear(h, h, bias=False)).to(device)
        opt = torch.optim.Adam(net.parameters(), lr=1e-4)

        def batch(gen):
            x = torch.randn(2, h, generator=gen).to(device)  # the state is large, not the work
            return x, torch.randint(0, h, (2,), generator=gen).to(device)
        return net, opt, batch, None
    if model == "gpt":
        cfg = GPT[size]
        net = GPTModel(**cfg).to(device)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

        def batch(gen):
            idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=gen)
            idx = idx.to(device, non_blocking=True)
            return idx[:, :-1], idx[:, 1:]
    else:
        cfg = RESNET[size]
        net = ResNet(**cfg).to(device)
        if gpu:
            net = net.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

        def batch(gen):
            x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], generator=gen)
            y = torch.randint(0, cfg["classes"], (cfg["batch"],), generator=gen)
            x = x.to(device, non_blocking=True)
            if gpu:
                x = x.contiguous(memory_format=torch.channels_last)
            return x, y.to(device, non_blocking=True)
    return net, opt, batch, (torch.bfloat16 if gpu and size == "full" else None)


def train_step(net, opt, batch, gen, amp):
    """One iteration (in a function: the batch and activations are not the loop's locals,
    which cfrun would capture). Returns the loss as a float (a host sync on CUDA)."""
    x, y = batch(gen)
    with torch.autocast(x.device.type, dtype=amp or torch.float32, enabled=amp is not None):
        out = net(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def state_bytes(net, opt):
    """Bytes of the parameters, buffers and optimizer state."""
    n = sum(t.numel() * t.element_size() for t in net.state_dict().values())
    return n + sum(v.numel() * v.element_size() for st in opt.state.values()
                   for v in st.values() if torch.is_tensor(v))


def main():
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # the persist agent and cfrun's threads get the other core
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    net, opt, batch, amp = build(args.model, args.size, device, args.state_mb)
    for spec in args.contenders.split(","):
        name, kind, k, *more = spec.split(":")
        k, steps = int(k), int(more[0]) if more else args.steps
        ckpt = None
        if kind != "none":
            ckpt = Checkpointer(kind, os.path.join(args.ckpt_dir, name), net, opt)
        stamps = []
        for step in range(steps):
            stamps.append(time.perf_counter())
            train_step(net, opt, batch, gen, amp)
            if ckpt is not None and (step + 1) % k == 0:
                ckpt.save(step + 1)
        stamps.append(time.perf_counter())
        if ckpt is not None:
            ckpt.close()
        iter_s = [b - a for a, b in zip(stamps, stamps[1:])][WARMUP_ITERS:]
        result = {"name": name, "kind": kind, "k": k, "steps": steps,
                  "iter_ms": [round(1e3 * s, 3) for s in iter_s],
                  "state_bytes": state_bytes(net, opt), "device": str(device)}
        if ckpt is not None:
            result["stall_s"], result["pgt_s"] = ckpt.stall_s, ckpt.pgt_s
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

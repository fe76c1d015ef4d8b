"""Mixed precision by hand: a bf16 model trained through fp32 master weights (issue 18, item 3).

The optimizer holds standalone ``nn.Parameter(p.float())`` copies that no module owns (as
hand-written mixed-precision scripts and Apex's O2 do): each step computes the loss with the bf16
model, moves its gradients onto the fp32 masters, steps the optimizer over the masters, and
copies them back into the bf16 model. The masters carry the precision the bf16 model rounds
away, so a resume that restores the model and the optimizer's moments but not the masters goes
on from their initial values and ends elsewhere. Writes the final model, masters and optimizer
state to --out.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(args.device, dtype)
    master = [nn.Parameter(q.detach().float()) for q in model.parameters()]
    opt = torch.optim.Adam(master, lr=1e-3)
    target = torch.randn(8, 32, device=args.device)
    for step in range(args.steps):
        x = torch.randn(16, 32, device=args.device)
        y = x @ target.T
        loss = F.mse_loss(model(x.to(dtype)).float(), y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        for m, q in zip(master, model.parameters()):
            m.grad = q.grad.float()
        opt.step()
        with torch.no_grad():
            for m, q in zip(master, model.parameters()):
                q.copy_(m)
        print(f"step {step} loss {loss.item():.8f}", flush=True)
    torch.save({"model": model.state_dict(), "master": [m.detach() for m in master],
                "opt": opt.state_dict()}, args.out)


if __name__ == "__main__":
    main()

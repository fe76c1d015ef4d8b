"""A CUDA trainer with AMP (float16 autocast, GradScaler), Adam and CUDA RNG draws for cfrun's
GPU crash tests (issue 18). With --side-stream the loop body runs under ``with
torch.cuda.stream(s)``: the optimizer steps on ``s`` while cfrun's boundary is on the default
stream (item 6). Deterministic (``torch.use_deterministic_algorithms``; the test sets
``CUBLAS_WORKSPACE_CONFIG``). Writes the final model, optimizer and scaler state to --out."""
import argparse
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--side-stream", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", growth_interval=5)
    target = torch.randn(256, 256, device="cuda")
    stream = torch.cuda.Stream() if args.side_stream else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    for step in range(args.steps):
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            x = torch.randn(64, 256, device="cuda")
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(x).float(), x @ target)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    torch.cuda.synchronize()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "scaler": scaler.state_dict()}, args.out)


if __name__ == "__main__":
    main()

"""A whole training step (forward, backward, optimizer.step()) captured in one CUDA graph and
replayed, as in PyTorch's "whole network capture" example (issue 18, item 11): the replays run
no Python, so no optimizer hook fires. Prints ``DONE``."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
static_x = torch.randn(16, 64, device="cuda")
static_y = torch.randn(16, 8, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):  # warm-up, as the example does
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(static_x), static_y).backward()
        opt.step()
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
opt.zero_grad(set_to_none=True)
with torch.cuda.graph(graph):
    static_loss = nn.functional.mse_loss(model(static_x), static_y)
    static_loss.backward()
    opt.step()
for _ in range(20):
    static_x.copy_(torch.randn(16, 64, device="cuda"))
    graph.replay()
torch.cuda.synchronize()
print("DONE", flush=True)

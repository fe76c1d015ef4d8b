"""Keeps its progress in an open file's position (one number read per step): cfrun cannot store
an open file, so after a resume the file is read from its start again. cfrun verify: not exact."""
import torch

torch.manual_seed(0)
with open("numbers.txt", "w") as f:
    f.write("".join(f"{1 + i / 100}\n" for i in range(400)))
numbers = open("numbers.txt")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(300):
    scale = float(numbers.readline())
    x = torch.randn(8, 4)
    loss = (model(x) * scale).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

"""A seeded trainer that saves its own state_dicts (model, optimizer, LR scheduler, GradScaler)
with ``torch.save`` into the directory given as argv[1]: the files cfrun must leave untouched."""

import sys

import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
scaler = torch.amp.GradScaler("cpu")
for step in range(8):
    x = torch.randn(16, 4)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
out = sys.argv[1]
torch.save(model.state_dict(), f"{out}/model.pt")
torch.save(opt.state_dict(), f"{out}/optimizer.pt")
torch.save(sched.state_dict(), f"{out}/scheduler.pt")
torch.save(plateau.state_dict(), f"{out}/plateau.pt")
torch.save(scaler.state_dict(), f"{out}/scaler.pt")
print("final", float(loss))

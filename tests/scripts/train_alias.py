"""Script variables that alias the live model and optimizer, and copies the script made.

``sd = model.state_dict()`` before the loop (detached views of the parameters and buffers), a
list of views of the parameters, a row of a weight (a view with its graph), an optimizer
``state_dict()`` taken mid-loop (its moments are the optimizer's own tensors), and copies:
``.clone()``, ``copy.deepcopy(model.state_dict())``. Saves them all (and whether each alias
still shares its storage with the live objects) to argv[1] at the end; under cfrun, after a
kill and resume, the file must equal a plain run's bit for bit.
"""

import copy
import sys

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
sd = model.state_dict()
views = [p.detach().view(-1) for p in model.parameters()]
row = model[0].weight[1]  # a view of row 1 (storage offset 4) that requires grad
clone = model[2].weight.detach().clone()
deep = copy.deepcopy(model.state_dict())
moments = None
snap = None
for step in range(60):
    x = torch.randn(16, 4)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 5:
        moments = opt.state_dict()
        snap = model[0].bias.detach().clone()

live = model.state_dict()
first = opt.state[model[0].weight]
shares = {
    "sd": all(sd[k].data_ptr() == live[k].data_ptr() for k in live),
    "views": [v.data_ptr() == p.data_ptr() for v, p in zip(views, model.parameters())],
    "row": (row.data_ptr() == model[0].weight[1].data_ptr(), row.requires_grad,
            row.grad_fn is not None, row.is_leaf),
    "moments": moments["state"][0]["exp_avg"].data_ptr() == first["exp_avg"].data_ptr(),
    "clone": clone.data_ptr() != model[2].weight.data_ptr(),
}
torch.save({"sd": sd, "views": views, "row": row.detach(), "clone": clone, "deep": deep,
            "moments": moments, "snap": snap, "shares": shares}, sys.argv[1])
print("shares", shares)
print("FINAL", loss.item())

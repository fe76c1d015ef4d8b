"""A step loop holding two tensors larger than cfrun stores (issue 27, item 7): ``logits``, a
loop temporary assigned before it is read at every step, and ``carry``, read across steps.

    python loop_temporaries.py OUT [NBYTES]

Saves the final model and the running loss total to OUT.
"""

import sys

import torch

torch.manual_seed(0)
nbytes = int(sys.argv[2]) if len(sys.argv) > 2 else 270_000_000
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
carry = torch.empty(nbytes, dtype=torch.uint8)  # read at every step: it must be stored
carry[:1] = 0
total = 0.0
for step in range(8):
    logits = torch.empty(nbytes, dtype=torch.uint8)  # a temporary: written before read
    logits[:4] = step
    x = torch.randn(8, 4)
    loss = model(x).pow(2).mean() + 0 * float(logits[:4].sum()) + 0 * float(carry[0])
    opt.zero_grad()
    loss.backward()
    opt.step()
    carry[:1] += 1
    total += loss.item()
torch.save({"model": model.state_dict(), "total": total}, sys.argv[1])

"""A step loop whose model, optimizer and scheduler are locals of ``main()``: they are gone
when the process ends, where cfrun takes the final checkpoint (issue 27, item 2).

    python train_main_fn.py STEPS OUT

Saves the final model's ``state_dict()`` to OUT.
"""
import sys

import torch


def main() -> None:
    steps, out = int(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    for step in range(steps):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    torch.save(model.state_dict(), out)


if __name__ == "__main__":
    main()

"""Trains in a non-daemon thread that the main thread starts and does not join: the main
thread's code returns at once, and Python ends the process when the thread does. It also
leaves an idle ``ThreadPoolExecutor`` open (its worker is a non-daemon thread that Python's
end tells to exit, as ``torch.distributed.checkpoint.async_save``'s would be).

``train_in_thread.py OUT``: 60 SGD steps of a linear model (a 20 ms sleep each), the final
weights saved to OUT, ``FINAL <loss>`` printed."""

import concurrent.futures
import sys
import threading
import time

import torch


def train(out: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(60):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.02)
    torch.save(model.state_dict(), out)
    print("FINAL", loss.item())


pool = concurrent.futures.ThreadPoolExecutor(1)  # never shut down
pool.submit(print, "pool ready").result()
threading.Thread(target=train, args=(sys.argv[1],)).start()

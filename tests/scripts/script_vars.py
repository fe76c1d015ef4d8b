"""A step loop whose module-level variables are the kinds real scripts hold: a meter with an Enum
summary type, a dataclass config, a namedtuple, a deque, a Counter, a defaultdict, a datetime and
a Path. Prints them all at the end; after a kill and resume they must equal an uninterrupted run's."""

import collections
import dataclasses
import datetime
import enum
import pathlib

import torch


class Summary(enum.Enum):
    NONE = 0
    AVERAGE = 1


class AverageMeter:
    def __init__(self, name, summary_type=Summary.AVERAGE):
        self.name, self.summary_type = name, summary_type
        self.sum = 0.0
        self.count = 0

    def update(self, v):
        self.sum += v
        self.count += 1

    def summary(self):
        return self.sum / self.count if self.summary_type is Summary.AVERAGE else None


@dataclasses.dataclass(frozen=True)
class Config:
    lr: float
    kind: Summary


Stat = collections.namedtuple("Stat", ["step", "loss"])

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
meter = AverageMeter("loss")
cfg = Config(0.05, Summary.NONE)
last = Stat(-1, 0.0)
history = collections.deque(maxlen=3)
counts = collections.Counter()
by_parity = collections.defaultdict(list)
when = datetime.datetime(2026, 1, 1)
path = pathlib.Path("ckpt")
for step in range(60):
    x = torch.randn(8, 4)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    v = round(loss.item(), 6)
    meter.update(v)
    last = Stat(step, v)
    history.append(v)
    counts[step % 3] += 1
    by_parity[step % 2].append(step)
    when = when + datetime.timedelta(seconds=step)
    path = pathlib.Path("ckpt") / f"{step}.pt"
    if step % 4 == 0:
        cfg = Config(cfg.lr * 0.9, Summary.AVERAGE)
print("FINAL", meter.summary_type, round(meter.summary(), 6), meter.count, cfg, last,
      list(history), sorted(counts.items()), len(by_parity[0]), type(by_parity).__name__,
      when.isoformat(), path, type(last).__name__, type(history).__name__)

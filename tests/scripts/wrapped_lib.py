"""A loader wrapper in a module of its own, as a framework ships it (Lightning Fabric's
``setup_dataloaders`` returns such an object): ``__iter__`` is a generator that moves each batch
to the device. Imported by train_wrapped.py (WRAPPER ``library``)."""

import torch


class DeviceLoader:
    def __init__(self, loader, device="cpu"):
        self.loader = loader
        self.device = torch.device(device)

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield [t.to(self.device) for t in batch]

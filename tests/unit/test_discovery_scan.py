"""The one scan of live objects at the first optimizer step (cfrun.rank.discovery): it finds
the outermost modules once each. A weak proxy of a module beside them (Lightning's Trainer
holds one of its LightningModule) passes ``isinstance(p, nn.Module)``: it counted as a second
root (every checkpoint held that model twice), and once the FSDP1 check reused this scan
(issue 27, item 9) it broke the first step of every Lightning job (a proxy cannot be weakly
referenced)."""

from __future__ import annotations

import weakref

import torch

from cfrun.rank.discovery import Discovery, uncheckpointable


def test_a_weak_proxy_of_the_model_is_no_trouble_and_the_model_is_found():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    wrapper = torch.nn.Sequential(model)  # an outer module around the model, as DDP is
    proxy = weakref.proxy(wrapper)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    found = Discovery(flag=lambda why: None)
    found.register_optimizer(opt)
    assert found.model_roots() == [wrapper]
    assert wrapper in found.outer_modules()
    assert uncheckpointable(found) is None  # no FSDP1, and no TypeError from the proxy
    assert proxy[0] is model
    del wrapper, proxy

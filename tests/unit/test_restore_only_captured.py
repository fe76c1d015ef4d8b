"""Issue 32, finding 3: a checkpoint sets only what was captured, and file paths only inside
their owner's directory, in the frameworks' adapters too (real Lightning and transformers
objects, real files). The script-variable side runs end to end in
``tests/integration/test_manifest_mac.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from cfrun.rank.frames import bound_names, path_within


def test_a_module_binds_what_it_assigns_imports_defines_or_stores_global_only():
    code = compile("import os.path\nfrom pathlib import Path as P\nbest = 0\n"
                   "for i in range(3):\n    pass\n"
                   "def f():\n    global counter\n    counter = 1\n"
                   "class C:\n    inner = 2\nprint(best)\n", "train.py", "exec")
    assert bound_names(code) == {"os", "P", "best", "i", "f", "counter", "C"}
    assert "print" not in bound_names(code) and "inner" not in bound_names(code)


@pytest.mark.parametrize("value,root,inside", [
    ("out/e3.pt", "out", True), ("out/../victim", "out", False), ("/a/b/c", "/a/b", True),
    ("/a/bc", "/a/b", False), ("e.pt", ".", True), ("../e.pt", ".", False),
    ("/etc/passwd", ".", False), ("x", None, False)])
def test_a_path_is_within_a_directory_lexically(value, root, inside):
    assert path_within(value, root) is inside


def test_lightning_model_checkpoint_state_keeps_no_path_outside_its_dirpath(tmp_path):
    """The review's crafted ``ModelCheckpoint`` state (``best_k_models`` and the path fields
    naming ``<dirpath>/../victim``, the saved ``dirpath`` the live one, so Lightning restores
    them): after cfrun's restore no path outside ``dirpath`` is left for the top-k eviction to
    delete; paths inside stay."""
    pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from cfrun.rank.adapters import lightning as PL

    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    cb = ModelCheckpoint(dirpath=str(ckpts), monitor="loss", save_top_k=2)
    outside, inside = f"{ckpts}/../victim.txt", str(ckpts / "epoch=1.ckpt")
    state = {"monitor": "loss", "best_model_score": torch.tensor(0.1),
             "best_model_path": outside, "current_score": torch.tensor(0.1),
             "dirpath": str(ckpts), "best_k_models": {outside: torch.tensor(0.1),
                                                      inside: torch.tensor(0.2)},
             "kth_best_model_path": outside, "kth_value": torch.tensor(0.1),
             "last_model_path": outside}
    trainer = SimpleNamespace(callbacks=[cb],
                              fit_loop=SimpleNamespace(load_state_dict=lambda s: None))
    PL._restore(trainer, {"fit_loop": "{}", "files": "{}",
                          "callbacks": json.dumps({cb.state_key: PL._encode(state)})})
    assert list(cb.best_k_models) == [inside]
    assert outside not in (cb.best_model_path, cb.kth_best_model_path, cb.last_model_path)
    assert victim.read_text() == "precious"


def test_hf_trainer_state_and_callbacks_take_only_their_own_fields_of_their_types():
    """``TrainerState(**saved)`` no more: a field the dataclass lacks is dropped (it used to
    raise or, on a permissive class, be set), one of another type keeps the live value; a
    callback gets only public attributes it has, of the live value's type."""
    pytest.importorskip("transformers")
    from transformers import TrainerState

    from cfrun.rank.adapters import hf as HF

    live = TrainerState()
    got = HF.trainer_state(live, {"global_step": 7, "epoch": 1.5, "evil": "x",
                                  "log_history": "not a list"})
    assert (got.global_step, got.epoch, got.log_history) == (7, 1.5, [])
    assert not hasattr(got, "evil")
    cb = SimpleNamespace(patience=3, on_train_end=lambda: None)
    assert HF._fits("patience", 1, cb) and not HF._fits("patience", "1", cb)
    assert not HF._fits("on_train_end", "boom", cb) and not HF._fits("new_attr", 1, cb)
    assert not HF._fits("_private", 1, SimpleNamespace(_private=0))

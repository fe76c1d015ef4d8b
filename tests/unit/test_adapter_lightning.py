"""cfrun.rank.adapters.lightning: the version gate, the JSON form of callback states, and what
:func:`capture` records at the training DataLoader's ``next()`` inside Lightning's fit loop."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from cfrun.rank import adapters
from cfrun.rank.adapters import lightning as PL


def test_the_lightning_adapter_stays_off_on_an_untested_version(monkeypatch):
    monkeypatch.setattr(adapters, "installed_version", lambda dist: "2.0.0")
    why = PL.untested_reason()
    assert why is not None and why.startswith("lightning 2.0.0 is not a version") \
        and "2.6.6" in why
    assert PL.capture(sys._getframe()) is None  # and no fit loop frame here anyway


def test_callback_states_round_trip_through_json_bit_for_bit():
    state = {"best_model_score": torch.tensor(0.1234567, dtype=torch.float32),
             "kth_value": torch.tensor(float("inf")), "best_model_path": "",
             "best_k_models": {"a.ckpt": torch.tensor(1.0 / 3.0)}, "monitor": None,
             "scores": [1, 2.5, True]}
    back = PL._decode(json.loads(json.dumps(PL._encode(state))))
    for key in ("best_model_score", "kth_value"):
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key])
    assert torch.equal(back["best_k_models"]["a.ckpt"], state["best_k_models"]["a.ckpt"])
    assert back["monitor"] is None and back["scores"] == [1, 2.5, True]
    with pytest.raises(TypeError):
        PL._encode({"lock": object()})


def test_capture_at_the_loaders_next_records_the_fit_loop_between_two_batches(tmp_path):
    """Each batch's first ``__getitem__`` runs inside the training DataLoader's ``next()``,
    where cfrun's boundary is: the capture there has every batch counter complete, the epoch
    and step counts of the batches before, and, after a batch that ran validation, the
    loggers' step one lower (Lightning's restart counts it again)."""
    L = pytest.importorskip("lightning")
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    got: list[dict] = []

    class Rows(Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            if self.first:
                self.first = False
                got.append(PL.capture(sys._getframe()))
            return torch.full((4,), float(i)), i % 2

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            train.dataset.first = True  # the next batch's first sample captures
            return F.cross_entropy(self.lin(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", F.cross_entropy(self.lin(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = Rows()
    data.first = True
    train = DataLoader(data, batch_size=3)  # 4 batches per epoch
    val = DataLoader(TensorDataset(torch.randn(4, 4), torch.zeros(4, dtype=torch.long)),
                     batch_size=4)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        val_check_interval=0.5, num_sanity_val_steps=0,
                        default_root_dir=str(tmp_path))
    trainer.fit(Net(), train, val)
    assert len(got) == 8 and all(g is not None for g in got)
    loops = [json.loads(g["fit_loop"]) for g in got]
    for k, state in enumerate(loops):
        epoch, batch = divmod(k, 4)
        progress = state["epoch_loop.batch_progress"]
        assert set(progress["current"].values()) == {batch}  # ready..completed all equal
        assert progress["total"]["completed"] == k
        assert state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"][
            "step"]["total"]["completed"] == k
        assert state["epoch_progress"]["current"]["processed"] == epoch
        # validation after batches 2 and 4 of each epoch, and the fresh epoch's start reads as
        # a validation batch too (batch_idx -1): one lower there
        after_val = batch in (0, 2)
        assert state["epoch_loop.state_dict"]["_batches_that_stepped"] == k - after_val


def test_a_checkpoint_file_the_killed_process_wrote_is_written_again_under_its_name(tmp_path):
    """After a resume, a ``ModelCheckpoint`` file written after cfrun's checkpoint (by a step
    computed again now) does not make Lightning's version counter name the new one ``-v1``;
    one that was there at cfrun's checkpoint still does, and so does one this process wrote."""
    pytest.importorskip("lightning")
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    PL._patch_model_checkpoint()
    cb = ModelCheckpoint(dirpath=str(tmp_path), filename="{step}")
    (tmp_path / "old.ckpt").write_text("")
    files = json.dumps({cb.state_key: ["old.ckpt"]})
    (tmp_path / "redone.ckpt").write_text("")  # written after the checkpoint, before the kill
    trainer = SimpleNamespace(
        callbacks=[cb], is_global_zero=True, global_step=5, loggers=[],
        strategy=SimpleNamespace(reduce_boolean_decision=lambda local, all: local),
        fit_loop=SimpleNamespace(load_state_dict=lambda state: None),
        save_checkpoint=lambda path, weights_only: open(path, "w").close())
    PL._restore(trainer, {"fit_loop": "{}", "callbacks": "{}", "files": files})
    redone, old = str(tmp_path / "redone.ckpt"), str(tmp_path / "old.ckpt")
    assert not cb.file_exists(redone, trainer) and cb.file_exists(old, trainer)
    cb._save_checkpoint(trainer, redone)
    assert cb.file_exists(redone, trainer)

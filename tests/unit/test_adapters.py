"""cfrun.rank.adapters: the import hook that patches a framework, and the version gate."""

from __future__ import annotations

import sys

from cfrun.rank import adapters
from cfrun.rank.adapters import hf as HF
from cfrun.rank.adapters import when_imported


def test_when_imported_runs_after_the_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "cfrun_probe_mod.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("cfrun_probe_mod", lambda: seen.append(sys.modules["cfrun_probe_mod"].VALUE))
    assert seen == []  # not imported yet
    import cfrun_probe_mod  # noqa: F401

    assert seen == [7]
    when_imported("cfrun_probe_mod", lambda: seen.append(0))  # already imported: now
    assert seen == [7, 0]
    del sys.modules["cfrun_probe_mod"]


def test_the_trainer_adapter_stays_off_on_an_untested_version(monkeypatch):
    monkeypatch.setattr(adapters, "installed_version", lambda dist: "4.0.0")
    why = HF.untested_reason()
    assert why is not None and why.startswith("transformers 4.0.0 is not a version") \
        and "5.24.0" in why
    assert HF.capture(sys._getframe()) is None  # and no Trainer frame here anyway

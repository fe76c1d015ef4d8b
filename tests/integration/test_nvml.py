"""GPUs through NVML with a fake NVML (tests/fakes/pynvml.py) on this GPU-less machine: an XID
during an attempt makes the failure a hardware fault (named, not counted towards --crash-loop),
status and the metrics show the GPUs, the profile fingerprint has their UUIDs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SCRIPTS, clean_env

pytestmark = pytest.mark.timeout(300)
FAKES = ROOT / "tests" / "fakes"
DEVICES = [{"uuid": "GPU-fake-0", "name": "Fake H100", "used": 40 * 10**9,
            "total": 80 * 10**9, "util": 97, "ecc": 0},
           {"uuid": "GPU-fake-1", "name": "Fake H100", "used": 1 * 10**9,
            "total": 80 * 10**9, "util": 3, "ecc": 0}]


def _env(state: Path) -> dict[str, str]:
    state.write_text(json.dumps({"devices": DEVICES, "xids": []}))
    import os

    return clean_env({"FAKE_NVML_STATE": str(state),
                      "PYTHONPATH": os.pathsep.join([str(FAKES), str(ROOT)])})


@pytest.mark.slow
def test_an_xid_during_an_attempt_is_a_hardware_fault_not_a_crash_loop(tmp_path):
    """--crash-loop 1 stops at the script's first failure of its own (exit 5); the first
    failure came with an XID on GPU 1, so it restarted instead, and said why."""
    state = tmp_path / "nvml.json"
    env = _env(state)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cfrun", "--interval", "5", "--crash-loop", "1", "--job-dir", "j",
         str(SCRIPTS / "fail_at_step.py"), "30"], cwd=tmp_path, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    job = tmp_path / "j"
    deadline = time.monotonic() + 120
    while not [p for p in job.glob("heartbeat-rank-*") if p.read_text().strip()]:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    doc = json.loads(state.read_text())
    doc["xids"].append([1, 79])  # GPU 1 fell off the bus
    state.write_text(json.dumps(doc))
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 5, err[-3000:]  # the second attempt's failure is the script's
    events = [json.loads(line) for line in (job / "events.jsonl").read_text().splitlines()]
    failures = [e for e in events if e["event"] == "failure"]
    assert failures[0]["cause"] == "GPU hardware fault: XID 79 on GPU 1 (GPU-fake-1)"
    assert failures[1]["cause"] != failures[0]["cause"]
    assert [e["attempt"] for e in events if e["event"] == "attempt_start"] == [0, 1]
    assert "restart 1 of 5" in err and "XID 79 on GPU 1" in err
    status = subprocess.run([sys.executable, "-m", "cfrun", "status", "j", "--json"],
                            cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    st = json.loads(status.stdout)
    assert st["restarts"][0]["cause"].startswith("GPU hardware fault")
    assert [g["uuid"] for g in st["gpus"]] == ["GPU-fake-0", "GPU-fake-1"]
    assert st["gpus"][0]["memory_used_bytes"] == 40 * 10**9
    table = subprocess.run([sys.executable, "-m", "cfrun", "status", "j"], cwd=tmp_path,
                           env=env, text=True, capture_output=True, timeout=300)
    assert "Fake H100: 40.0/80.0 GB, 97% busy" in table.stdout.replace("\n", "")
    metrics = subprocess.run([sys.executable, "-m", "cfrun", "status", "j", "--metrics"],
                             cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    assert 'cfrun_restarts_total{cause="hardware"} 1.0' in metrics.stdout
    assert 'cfrun_gpu_utilization_ratio{gpu="0",uuid="GPU-fake-0"} 0.97' in metrics.stdout


def test_rising_ecc_counts_are_a_hardware_fault_and_cuda_visible_devices_limits_the_gpus(
        tmp_path, monkeypatch):
    state = tmp_path / "nvml.json"
    env = _env(state)
    monkeypatch.setenv("FAKE_NVML_STATE", env["FAKE_NVML_STATE"])
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    from cfrun.contract import gpus

    watch = gpus.FaultWatch()
    watch.start()
    assert watch.faults() == []
    doc = json.loads(state.read_text())
    doc["devices"][0]["ecc"] = 2
    state.write_text(json.dumps(doc))
    assert watch.faults() == ["ECC: 2 uncorrected errors on GPU 0 (GPU-fake-0)"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-1")
    assert gpus.device_uuids() == ["GPU-fake-1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpus.device_uuids() == ["GPU-fake-0"]


def test_without_nvml_everything_is_empty_and_nothing_raises(monkeypatch):
    monkeypatch.delenv("FAKE_NVML_STATE", raising=False)
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    from cfrun.contract import gpus

    assert gpus.samples() == [] and gpus.device_uuids() == []
    watch = gpus.FaultWatch()
    watch.start()
    watch.poll()
    assert watch.faults() == []


def test_the_profile_fingerprint_has_the_gpu_uuids(tmp_path, monkeypatch):
    state = tmp_path / "nvml.json"
    env = _env(state)
    monkeypatch.setenv("FAKE_NVML_STATE", env["FAKE_NVML_STATE"])
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    from cfrun.rank.tuner import fingerprint

    script = str(SCRIPTS / "fail_at_step.py")
    first = fingerprint(script, [], 1)
    doc = json.loads(state.read_text())
    doc["devices"][1]["uuid"] = "GPU-fake-other"
    state.write_text(json.dumps(doc))
    assert fingerprint(script, [], 1) != first

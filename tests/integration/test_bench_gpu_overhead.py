"""bench/gpu_overhead.py at its smallest size (CPU): every kind of contender (plain, the script
under torchrun, cfrun without checkpoints, cfrun with its policy and at k*, DCP and torch.save
at k*) on the GPT workload, for a few steps; it writes a
JSON with every field its table reads. The ResNet workload differs only in its model: its
training script runs two plain steps. Not timed: the numbers are not judged, only that each
one is there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, clean_env

pytestmark = pytest.mark.extended  # a bench's smoke run (docs/tests.md)


@pytest.mark.timeout(900)
def test_gpu_overhead_bench_writes_every_field(tmp_path):
    out = tmp_path / "gpu_overhead.json"
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_overhead
    finally:
        sys.path.pop(0)
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_overhead.py"), "--size", "small", "--workloads",
         "gpt",
         "--steps", "7", "--policy-steps", "2", "--multiples", "1", "--timeout", "300", "--idle",
         "--out", str(out),
         "--tmp-root", str(tmp_path)],
        env=clean_env(), capture_output=True, text=True, timeout=880, cwd=ROOT)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    data = json.loads(out.read_text())
    assert data["size"] == "small" and data["device"] in ("cpu", "cuda")
    assert [w["model"] for w in data["workloads"]] == ["gpt"]
    for w in data["workloads"]:
        assert w["state_bytes"] > 0 and w["k_star"] >= 1 and w["step_s"] > 0
        assert w["floors"]["copy_s"] > 0 and w["floors"]["disk_s"] > 0
        k = w["k_star"]
        rows = {r["name"]: r for r in w["rows"]}
        assert list(rows) == ["plain", "torchrun_plain", "cfrun_idle", "cfrun_policy",
                              "cfrun_k", "dcp_thread_k", "torch_save_k", "plain_after"]
        assert rows["cfrun_idle"]["checkpoints"] == 0  # a step's cost without checkpoints
        baseline_ms = (rows["plain"]["mean_ms"] + rows["plain_after"]["mean_ms"]) / 2
        assert rows["cfrun_k"]["overhead"] == pytest.approx(
            rows["cfrun_k"]["mean_ms"] / baseline_ms - 1)
        for name, r in rows.items():
            assert set(gpu_overhead.ROW_FIELDS) <= set(r), name
            assert r["ok"], (name, r["error"])
            assert r["mean_ms"] > 0 and r["median_ms"] > 0 and r["p99_ms"] >= 0, name
        assert rows["cfrun_k"]["k"] == rows["dcp_thread_k"]["k"] == k
        for name in ("cfrun_k", "dcp_thread_k", "torch_save_k"):
            r = rows[name]
            assert r["checkpoints"] >= 1 and r["stall_first_s"] is not None, name
            assert r["overhead"] is not None and r["persist_over_disk_floor"] > 0, name
        assert rows["cfrun_k"]["deferred"] is not None
        assert rows["cfrun_k"]["snapshot_over_copy_floor"] > 0
    assert "overhead" in p.stdout and "k* =" in p.stdout


def test_the_resnet_workload_trains(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "_gpu_overhead_train.py"), "--model",
                        "resnet", "--size", "small", "--steps", "2"],
                       env=clean_env(), capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]

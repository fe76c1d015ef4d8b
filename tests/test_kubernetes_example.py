"""The Kubernetes example matches cfrun's exit codes and grace semantics."""

from __future__ import annotations

import yaml
from conftest import ROOT

from cfrun.contract import errors


def test_job_manifest_uses_cfrun_exit_codes_and_fits_the_grace_period():
    docs = list(yaml.safe_load_all((ROOT / "examples" / "kubernetes" / "job.yaml").read_text()))
    job = next(d for d in docs if d["kind"] == "Job")
    rules = job["spec"]["podFailurePolicy"]["rules"]
    by_action = {}
    for r in rules:
        if "onExitCodes" in r:
            by_action.setdefault(r["action"], set()).update(r["onExitCodes"]["values"])
    assert by_action["Ignore"] == {errors.EXIT_PREEMPTED}
    assert by_action["FailJob"] == {errors.EXIT_BAD_INPUT, errors.EXIT_FATAL}
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # required by podFailurePolicy
    container = pod["containers"][0]
    assert container["command"] == ["cfrun"]
    grace = next(float(a.split("=")[1]) for a in container["args"] if a.startswith("--grace="))
    assert grace < pod["terminationGracePeriodSeconds"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts and any(a.startswith("--job-dir=/ckpt") for a in container["args"])

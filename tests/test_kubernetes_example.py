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


def _docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((ROOT / "examples" / "kubernetes" / name).read_text()))


def _dry_run(args: list[str], env: dict[str, str]) -> dict:
    """The manifest's cfrun command as cfrun itself resolves it (``--dry-run``: nothing runs)."""
    import json

    from conftest import cfrun_in_process

    run = cfrun_in_process(["--dry-run", *args], cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["config"]


def test_every_manifest_runs_cfrun_with_options_cfrun_accepts():
    for name in ("job.yaml", "multinode.yaml"):
        job = next(d for d in _docs(name) if d["kind"] == "Job")
        container = job["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["cfrun"]
        config = _dry_run(container["args"], {"CFRUN_NODE_RANK": "1"}
                          if name == "multinode.yaml" else {})
        assert config["script"] == str(ROOT / "examples" / "digits_train.py")


def test_the_multinode_indexed_job_matches_its_service_and_node_count():
    docs = _docs("multinode.yaml")
    service = next(d for d in docs if d["kind"] == "Service")
    job = next(d for d in docs if d["kind"] == "Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert service["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert spec["completionMode"] == "Indexed"
    container = pod["containers"][0]
    [rank_env] = [e for e in container["env"] if e["name"] == "CFRUN_NODE_RANK"]
    assert "job-completion-index" in rank_env["valueFrom"]["fieldRef"]["fieldPath"]
    config = _dry_run(container["args"], {"CFRUN_NODE_RANK": "1"})
    assert config["nnodes"] == spec["completions"] == spec["parallelism"] == 2
    assert config["node_rank"] == 1
    host, port = config["rdzv_endpoint"].split(":")
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    grace = config["grace_s"]
    assert grace < pod["terminationGracePeriodSeconds"]
    rules = spec["podFailurePolicy"]["rules"]
    codes = {r["action"]: set(r["onExitCodes"]["values"]) for r in rules if "onExitCodes" in r}
    assert codes == {"Ignore": {errors.EXIT_PREEMPTED},
                     "FailJob": {errors.EXIT_BAD_INPUT, errors.EXIT_FATAL}}
    [pvc] = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # both nodes write the job dir


def test_the_pytorchjob_takes_its_placement_from_the_operators_pet_variables():
    [ptj] = _docs("pytorchjob.yaml")
    assert ptj["kind"] == "PyTorchJob"
    replicas = ptj["spec"]["pytorchReplicaSpecs"]
    nnodes = sum(r["replicas"] for r in replicas.values())
    container = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["cfrun"]
    assert not [a for a in container["args"] if a.split("=")[0] in (
        "--nnodes", "--node-rank", "--rdzv-endpoint", "--nproc-per-node")]
    # what the training operator sets in the Worker's pod
    operator_env = {"PET_NNODES": str(nnodes), "PET_NODE_RANK": "1",
                    "PET_NPROC_PER_NODE": ptj["spec"]["nprocPerNode"],
                    "PET_MASTER_ADDR": "digits-ptj-master-0", "PET_MASTER_PORT": "23456"}
    config = _dry_run(container["args"], operator_env)
    assert (config["nnodes"], config["node_rank"], config["nproc_per_node"]) == (2, 1, 1)
    assert config["rdzv_endpoint"] == "digits-ptj-master-0:23456"
    pod = replicas["Worker"]["template"]["spec"]
    assert config["grace_s"] < pod["terminationGracePeriodSeconds"]

"""Defaults from the launcher around cfrun: torchrun's PET_* variables and SLURM (issue 15)."""

from __future__ import annotations

import pytest

from cfrun.contract.cluster import SLURM_PORT_BASE, cluster_defaults, first_host
from cfrun.contract.errors import BadInputError


@pytest.mark.parametrize(("nodelist", "host"), [
    ("node07", "node07"), ("node[07-09,12]", "node07"), ("gpu[3,5-6],cpu1", "gpu3"),
    ("a-b-1.example.org", "a-b-1.example.org"), ("localhost,other", "localhost"),
    ("node[001-004]", "node001"),
])
def test_first_host_of_a_slurm_host_list(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "node[x-y]", "[1-2]"])
def test_a_malformed_host_list_is_refused(nodelist):
    with pytest.raises(BadInputError, match="SLURM_JOB_NODELIST"):
        first_host(nodelist)


def _values(env):
    return {k: v for k, (v, _) in cluster_defaults(env).values.items()}


def test_slurm_gives_nodes_rank_rendezvous_id_and_gpus():
    env = {"SLURM_JOB_ID": "123456", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "gpu[10-13]", "SLURM_GPUS_ON_NODE": "8"}
    assert _values(env) == {"nnodes": "4", "node_rank": "2",
                            "rdzv_endpoint": f"gpu10:{SLURM_PORT_BASE + 123456 % 20000}",
                            "rdzv_id": "slurm-123456", "nproc_per_node": "8"}
    assert cluster_defaults(env).get("node_rank") == ("2", "SLURM_NODEID")
    assert _values({**env, "MASTER_PORT": "29999"})["rdzv_endpoint"] == "gpu10:29999"


def test_pet_variables_beat_slurm_and_master_addr_makes_the_endpoint():
    env = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "n1", "PET_NNODES": "2", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "trainer-master-0", "PET_MASTER_PORT": "23456",
           "PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "3"}
    assert _values(env) == {"nnodes": "2", "node_rank": "1",
                            "rdzv_endpoint": "trainer-master-0:23456", "rdzv_id": "slurm-7",
                            "nproc_per_node": "2", "max_restarts": "3"}
    assert _values({"PET_RDZV_ENDPOINT": "h:1", "PET_MASTER_ADDR": "x"})["rdzv_endpoint"] == "h:1"


def test_an_elastic_node_range_is_refused_a_fixed_one_taken():
    assert _values({"PET_NNODES": "3:3"})["nnodes"] == "3"
    with pytest.raises(BadInputError, match="PET_NNODES='1:4' asks for an elastic node count"):
        cluster_defaults({"PET_NNODES": "1:4"})


def test_nothing_without_a_launcher_and_blank_values_are_ignored():
    assert _values({"HOME": "/root"}) == {}
    assert _values({"PET_NNODES": " ", "SLURM_NNODES": "2"}) == {}  # no SLURM_JOB_ID

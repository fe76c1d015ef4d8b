"""profiles/: checked-in reference profiles in the job dir cache's schema; the policy must
reproduce each stored decision from its stored costs."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT

from cfrun.policy import Costs, choose_interval

PROFILES = sorted((ROOT / "profiles").glob("*.json"))


def test_there_are_reference_profiles():
    assert PROFILES


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_reference_profile_schema_and_decision(path):
    prof = json.loads(path.read_text())
    for key in ("fingerprint", "costs", "mode", "modes", "budget", "decision", "model_bytes",
                "description"):
        assert key in prof, key
    assert prof["mode"] in prof["modes"]
    decision = choose_interval(Costs(**prof["costs"]), prof["budget"], prof["mtbf_s"])
    assert decision.interval == prof["decision"]["interval"]
    assert decision.predicted_overhead <= prof["budget"] or \
        decision.interval in (decision.k_in_flight, decision.k_daly)

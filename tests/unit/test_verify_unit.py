"""cfrun verify's pure parts: the kill plan, the step digests' first divergence, the names of
checkpoint entries, and the rank settings that carry a verify run."""

from __future__ import annotations

import pytest
import torch

from cfrun.cli.verify_compare import first_divergence, unseeded_rngs, varying_variables
from cfrun.cli.verify_plan import AFTER_STEP, DURING_PERSIST, plan_kills
from cfrun.cli.verify_runs import stopped_at
from cfrun.codec.compare import differences, entry_names
from cfrun.contract.errors import BadInputError
from cfrun.contract.verify import StepDigest
from cfrun.rank.settings import RankSettings


def test_the_kill_plan_hits_the_hard_cases_in_step_order() -> None:
    # the digits example: 46 steps per epoch, interval 10, stop at 66
    plan = plan_kills(66, 10, [46], 1, 3)
    assert [(k.step, k.attempt, k.moment) for k in plan] == [
        (15, 0, AFTER_STEP), (46, 1, AFTER_STEP), (50, 2, DURING_PERSIST)]
    assert [k.case for k in plan] == ["inside an epoch", "right after an epoch's last step",
                                      "during a persist"]
    four = plan_kills(66, 10, [46], 1, 4)
    assert four[0].step == 5 and four[0].case == "before the first checkpoint"


def test_with_several_ranks_one_kill_is_of_a_rank_other_than_0() -> None:
    plan = plan_kills(43, 10, [23], 2, 3)
    assert plan[0].rank == 1 and plan[0].case == "inside an epoch, one rank of several"
    assert all(k.rank == 0 for k in plan[1:])


def test_the_kill_plan_stays_below_the_stop_step_and_without_epochs() -> None:
    plan = plan_kills(200, 10, [], 1, 6)
    steps = [k.step for k in plan]
    assert steps == sorted(set(steps)) and all(1 <= s < 200 for s in steps) and len(plan) == 6
    assert any(k.moment == DURING_PERSIST for k in plan)
    assert plan_kills(3, 10, [], 1, 3) == []  # no room below step 3


def _d(step: int, params: str, attempt: int = 0, **rng: str) -> StepDigest:
    return StepDigest(step=step, attempt=attempt, params=params,
                      rng={"torch": "t", "python": "p", "numpy": "n", **rng})


def test_first_divergence_names_the_first_step_and_what_differs() -> None:
    ref = [_d(s, f"p{s}") for s in range(1, 6)]
    same = ref[:3] + [_d(2, "p2", attempt=1), _d(3, "p3", attempt=1)]
    assert first_divergence(ref, same) is None
    other = ref[:3] + [_d(2, "p2", attempt=1), _d(3, "x", attempt=1, numpy="m")]
    assert first_divergence(ref, other) == (3, ["model parameters", "RNG numpy"])


def test_an_rng_that_differs_at_step_1_is_unseeded_and_can_be_left_aside() -> None:
    ref = [_d(1, "a"), _d(2, "b")]
    other = [_d(1, "a", python="q"), _d(2, "b", python="r")]
    assert unseeded_rngs(ref, other) == {"random"}
    assert first_divergence(ref, other) == (1, ["RNG python random"])
    assert first_divergence(ref, other, {"random"}) is None


def _state(weight: float, best: float, batches: int, numpy_pos: int) -> dict:
    return {
        "modules": [{"layer3.weight": torch.full((2, 2), weight)}],
        "optimizers": [{"state": {0: {"momentum_buffer": torch.zeros(2)}},
                        "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "opt_steps": [5], "model_bytes": 16,
        "rng": {"torch": torch.zeros(4, dtype=torch.uint8), "numpy": ("MT19937", numpy_pos)},
        "data": {"batches": batches, "epoch_rng": {"global": {"numpy": ("MT19937", 1)}}},
        "schedulers": [], "scalers": [],
        "script": [{"code": ["s.py", "<module>", 1],
                    "values": {"best_acc": {"kind": "value", "v": best}}}],
    }


def test_differences_are_named_in_the_users_terms_likely_causes_first() -> None:
    a = _state(1.0, 0.5, 3, 7)
    assert differences(a, _state(1.0, 0.5, 3, 7)) == []
    got = differences(a, _state(2.0, 0.75, 4, 8), loader="train_loader")
    assert [d.entry for d in got] == ["loader position of train_loader", "RNG numpy",
                                      "script variable best_acc", "model0.layer3.weight"]
    assert got[1].rng == "numpy" and got[0].rng is None
    assert "4 of 4 values differ" in got[3].detail
    names = entry_names(a, loader="train_loader")
    assert "optimizer0.state[0].momentum_buffer" in names and "optimizer0 step count" in names


def test_differences_compare_bits_not_values() -> None:
    a, b = _state(0.0, 0.5, 3, 7), _state(-0.0, 0.5, 3, 7)  # 0.0 == -0.0, but not its bits
    assert [d.entry for d in differences(a, b)] == ["model0.layer3.weight"]
    nan_a, nan_b = _state(float("nan"), 0.5, 3, 7), _state(float("nan"), 0.5, 3, 7)
    assert differences(nan_a, nan_b) == []


def test_rank_settings_carry_a_verify_run_and_refuse_a_bad_kill() -> None:
    s = RankSettings(job_dir=__import__("pathlib").Path("/j"), script="/s.py", verify=True,
                     verify_stop_step=66, verify_kills=((15, 0, 0, 0), (50, 2, 1, 1)))
    again = RankSettings.from_json(s.to_json(), rank=1, world_size=2)
    assert again.verify and again.verify_stop_step == 66
    assert again.verify_kills == ((15, 0, 0, 0), (50, 2, 1, 1))
    with pytest.raises(BadInputError, match="verify_kills"):
        RankSettings(job_dir=s.job_dir, script="/s.py", verify_kills=((15, 0, 0, 7),))
    with pytest.raises(BadInputError, match="verify_stop_step"):
        RankSettings(job_dir=s.job_dir, script="/s.py", verify_stop_step=0)


def test_only_script_variables_that_differ_between_uninterrupted_runs_are_set_aside() -> None:
    """Issue 27, item 6: a clock-recording variable differs in the second uninterrupted run
    too; a variable the resume changed (``lr``) and a model entry do not count."""
    killed = [{"entry": "script variable step_times", "detail": "a"},
              {"entry": "rank 1: script variable t_prev (in main())", "detail": "b"},
              {"entry": "script variable lr", "detail": "c"},
              {"entry": "model0.weight", "detail": "d"}]
    again = [{"entry": "script variable step_times", "detail": "x"},
             {"entry": "rank 1: script variable t_prev (in main())", "detail": "y"},
             {"entry": "model0.weight", "detail": "z"}]
    assert [d["entry"] for d in varying_variables(killed, again)] == [
        "script variable step_times", "rank 1: script variable t_prev (in main())"]
    assert varying_variables(killed, []) == []


def _lightning(batches_that_stepped: int, best: str, files: list[str]) -> dict:
    import json

    key = "ModelCheckpoint{'monitor': 'val_loss'}"
    return {"data": {"loader": 0, "lightning": {
        "fit_loop": json.dumps({"epoch_loop.state_dict": {
            "_batches_that_stepped": batches_that_stepped}}),
        "callbacks": json.dumps({key: {"best_model_path": best, "dirpath": "ck"}}),
        "files": json.dumps({key: files})}}}


def test_the_lightning_adapters_record_is_compared_loop_by_loop_and_callback_by_callback() -> None:
    """The Lightning fit loop's and callbacks' states (JSON in the loader position) are
    entries of their own; a callback's state and its directory listing, which the files an
    earlier run left in the directory decide (``ModelCheckpoint`` names a taken name
    ``-v1``), are set aside when two uninterrupted runs differ in them too; the fit loop's
    progress never is."""
    a = _lightning(3, "ck/best.ckpt", ["best.ckpt"])
    assert differences(a, _lightning(3, "ck/best.ckpt", ["best.ckpt"])) == []
    killed = [d.to_json() for d in differences(
        a, _lightning(4, "ck/best-v1.ckpt", ["best-v1.ckpt", "best.ckpt"]), loader="train")]
    key = "ModelCheckpoint{'monitor': 'val_loss'}"
    assert [d["entry"] for d in killed] == [
        "Lightning fit loop epoch_loop.state_dict",
        f"Lightning callback state {key}.best_model_path",
        f"Lightning ModelCheckpoint files of {key}"]
    assert killed[0]["detail"] == "3 vs 4"
    again = [d.to_json() for d in differences(
        a, _lightning(4, "ck/best-v2.ckpt", ["best-v1.ckpt", "best-v2.ckpt", "best.ckpt"]))]
    assert [d["entry"] for d in varying_variables(killed, again)] == [
        f"Lightning callback state {key}.best_model_path",
        f"Lightning ModelCheckpoint files of {key}"]
    assert "Lightning fit loop epoch_loop.state_dict" in entry_names(a)


def test_the_stop_is_compared_at_the_final_checkpoint_a_framework_loop_put_later(tmp_path
                                                                                ) -> None:
    """Lightning's boundary due at an epoch's last step (12) comes after the next epoch's
    first step: the run's final checkpoint is step 13, and the verify compares there."""
    from cfrun.contract.jobdir import step_dir_name

    for step in (3, 6, 9, 13):
        d = tmp_path / "checkpoints" / step_dir_name(step)
        d.mkdir(parents=True)
        (d / "manifest.json").write_text("{}")
    assert stopped_at(tmp_path, 12) == 13
    assert stopped_at(tmp_path, 9) == 9
    assert stopped_at(tmp_path, 14) == 14

"""The budget study on the compute axis (benchmarks/budget.py over benchmarks/harness.py), run for real at toy size:
every run records its curve with the compute of each probe point, the study models each run's compute from the steps
it took (each kind at the cost measured side by side), resumes by skipping finished runs, refuses runs of another
recipe, and reads compute_to_full_plain and the front off the curves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import budget  # noqa: E402
import harness  # noqa: E402

TOY = ["--student", "convnet", "--full", "6", "--train-size", "1500", "--test-size", "200"]
PLAN = {"convnet": [(1, None, None, "callable", [0.5, 1.0], range(2)),
                (1, "other", "default", "callable", [1.0, 2.0], range(2)),
                (1, "other", "constant:1", "callable", [1.0], range(2)),
                (1, "other", "default", "eager", [1.0], range(1))]}


@pytest.fixture(scope="module")
def study(tmp_path_factory, fashion_mnist_available):
    folder = tmp_path_factory.mktemp("budget")
    flags = [*TOY, "--runs", str(folder / "runs"), "--cache", str(folder / "cache"), "--out", str(folder / "b.json")]
    mp = pytest.MonkeyPatch()
    mp.setattr(budget, "PLANS", PLAN)
    budget.main([*flags, "--timing", "--timing-steps", "2"])
    budget.main(flags)
    yield folder, flags, json.loads((folder / "b.json").read_text())
    mp.undo()


def test_every_run_records_its_curve_with_compute_and_provenance(study):
    folder, _, result = study
    assert result["complete"] and result["runs_done"] == result["runs_planned"] == 2 * 2 + 2 * 2 + 2 + 1
    assert result["provenance"]["commit"] and result["provenance"]["machine"]
    for name, run in result["runs"].items():
        steps = run["run"]["steps"]
        # probed along every run (one run gives a curve); the full plain run at the study's finer fractions
        full_plain = not run["run"]["prior"] and steps == 6
        probes = {round(f * steps) for f in budget.FULL_PROBES} if full_plain else set(harness.probes_along(steps))
        assert [c["step"] for c in run["curve"]] == sorted({0, steps, *probes})
        cpu = [c["train_cpu_seconds"] for c in run["curve"]]
        assert cpu == sorted(cpu) and cpu[-1] == pytest.approx(run["train_cpu_seconds"]) and cpu[-1] > 0
        assert run["commit"] and run["recipe"]["student"] == "convnet"
        if run["run"]["prior"]:
            assert run["precompute"]["cpu_seconds"] > 0
    # the default arm's runs are named by the explicit spec they ran
    from accelerate_ssl.schedules import SWITCH_END_FRACTION

    default = [r for r in result["runs"].values() if r["run"]["prior"] and r["run"]["schedule"].startswith("switch")]
    assert default and {r["run"]["schedule"] for r in default} == {f"switch:{SWITCH_END_FRACTION:g}"}


def test_compute_is_modelled_from_the_steps_each_run_took(study):
    """Lambda-1 steps with the loss as a callable cost a 'callable' step, the eager form a full one, every step after the
    hand-over a plain one; the precompute is counted once."""
    _, _, result = study
    timing, size = result["timing"], 1500
    cost = {k: v["step_cpu_seconds"] for k, v in timing["kinds"].items()}
    for run in result["runs"].values():
        kinds = harness.step_kinds(run)
        lam = run["lambda_per_step"]
        if not lam:
            assert kinds == ["plain"] * run["run"]["steps"]
        elif run["run"]["loss"] == "eager":
            assert set(kinds[:lam.count(1.0)]) == {"eager"}
        else:
            first = lam.index(0.0) if 0.0 in lam else len(lam)
            assert kinds == ["callable" if v == 1.0 else "plain" for v in lam] and set(kinds[:first]) <= {"callable"}
        pre = timing["precompute"][run["run"]["prior"]]["cpu_seconds_per_image"] * size if run["run"]["prior"] else 0.0
        assert harness.modelled_compute(run, timing, size)[-1] == pytest.approx(pre + sum(cost[k] for k in kinds))
    assert timing["relative_cpu"]["plain"] == 1.0 and set(timing["kinds"]) == set(harness.STEP_KINDS)


def test_the_analysis_reads_compute_to_full_plain_and_the_front_off_the_curves(study):
    _, _, result = study
    an = result["analysis"]
    assert an["axis"] == "modelled" and result["measured"]["axis"] == "measured"
    full = [r for r in result["runs"].values() if r["run"]["prior"] is None and r["run"]["steps"] == 6]
    assert an["target_top1"] == pytest.approx(sum(r["curve"][-1]["top1"] for r in full) / len(full))
    for key, arm in an["arms"].items():
        c = arm["compute_to_full_plain"]
        assert len(c["per_seed"]) == len(arm["seeds"])
        for seed, x in zip(arm["seeds"], c["per_seed"]):
            curve = arm["curves"]["top1"][str(seed)]
            assert [y for _, y in curve] == sorted(y for _, y in curve)  # a running maximum
            if x is None:
                assert max(y for _, y in curve) < an["target_top1"] and c["reason"]
            elif curve[0][1] >= an["target_top1"]:  # at toy size the untrained student can start above the target
                assert x == curve[0][0]
            else:  # reached between two probe points: interpolated
                assert budget.curve_at(curve, x) == pytest.approx(an["target_top1"])
                assert all(y < an["target_top1"] for cx, y in curve if cx < x)
        for b, v in arm["at"].items():
            assert v["mean"] == pytest.approx(sum(v["per_seed"]) / len(v["per_seed"]))
    for b, best in an["best_at"].items():
        assert best["mean"] == max(arm["at"][b]["mean"] for arm in an["arms"].values() if b in arm["at"])
    # what the hand-over bought: the default's runs against constant:1's of the same length and seeds, at their ends
    h = budget.goals(an)["handover"]
    ends = {k: [r["curve"][-1]["top1"] for r in result["runs"].values() if r["run"]["prior"] == "other"
                and r["run"]["schedule"] == s and r["run"]["steps"] == 6 and r["run"]["loss"] == "callable"]
            for k, s in (("default", an["arms"]["other:default:callable"]["schedule"]), ("constant", "constant:1"))}
    assert h["steps"] == 6 and h["seeds"] == [0, 1]
    assert h["default"]["mean"] == pytest.approx(sum(ends["default"]) / 2)
    assert h["constant"]["mean"] == pytest.approx(sum(ends["constant"]) / 2)
    tables = budget.tables(result)
    assert {"front", "reach", "summary", "ends", "cost", "priors"} <= set(tables) and "(default)" in tables["front"]
    assert "What the hand-over bought: the default's 6-step runs" in tables["summary"]


def test_a_rerun_resumes_and_a_run_of_another_recipe_is_refused(study):
    folder, flags, _ = study
    files = sorted((folder / "runs").glob("*seed*.json"))
    before = {f: f.stat().st_mtime_ns for f in files}
    mp = pytest.MonkeyPatch()
    mp.setattr(budget, "PLANS", PLAN)
    try:
        budget.main(flags)  # every run is there: nothing trains again
        assert {f: f.stat().st_mtime_ns for f in files} == before
        victim = next(f for f in files if f.name.startswith("rela-"))
        record = json.loads(victim.read_text())
        record["recipe"]["lr"] = 0.5
        victim.write_text(json.dumps(record))
        with pytest.raises(ValueError, match="a run of another recipe.*move it away"):
            budget.main(flags)  # the plan meets it before training anything
    finally:
        mp.undo()


def test_side_by_side_interleaves_the_kinds_round_by_round_and_counts_no_warm_up():
    """The one timing loop every study uses: kinds in turn within a round, warm-up rounds not counted, ``between`` after
    every ``every``-th counted round, medians of what each kind's steps reported."""
    calls, between = [], []

    def kind(name, seconds):
        def step(i):
            calls.append((i, name))
            return {"step_seconds": [seconds[i]], "step_cpu_seconds": [2 * seconds[i]]}
        return step

    a = [100.0, 100.0, 1.0, 2.0, 3.0, 4.0, 50.0]  # the first two rounds are the warm-up: their 100 s never count
    b = [100.0, 100.0, 10.0, 10.0, 30.0, 20.0, 20.0]
    out = harness.side_by_side({"a": kind("a", a), "b": kind("b", b)}, rounds=5, between=between.append, every=2)
    assert calls == [(i, k) for i in range(7) for k in ("a", "b")]
    assert between == [2, 4, 6]
    assert out == {"a": {"seconds": 3.0, "cpu_seconds": 6.0}, "b": {"seconds": 20.0, "cpu_seconds": 40.0}}


def test_an_arms_curve_is_the_best_any_of_its_runs_had_reached_and_a_run_never_lowers_it():
    """Each run linear between its probes; the arm's curve at a compute is the best any run had reached by then."""
    long = [(0.0, 40.0), (0.3, 70.0), (0.6, 76.0), (0.9, 78.0)]
    short = [(0.0, 40.0), (0.4, 74.0), (0.8, 74.5)]  # ends below the long run, between two of its probes
    alone, both = budget.envelope([long]), budget.envelope([long, short])
    for x in (0.1, 0.3, 0.37, 0.45, 0.6, 0.75, 0.8, 0.85, 0.9):
        assert budget.curve_at(both, x) >= budget.curve_at(alone, x) - 1e-9
    assert budget.curve_at(both, 0.75) == pytest.approx(77.0)  # the long run's own line, not one through the short end
    assert budget.curve_at(both, 0.4) == pytest.approx(74.0)  # the short run is ahead there
    x = 24.0 / 65.0  # where short's 40 -> 74 over [0, 0.4] crosses long's 70 -> 76 over [0.3, 0.6]
    assert any(abs(cx - x) < 1e-9 for cx, _ in both)
    assert budget.curve_at(both, 0.35) == pytest.approx(71.0) and budget.curve_at(both, 0.38) == pytest.approx(72.3)
    # a run that dips keeps its best; one that starts above the others steps the curve up where it starts
    assert budget.run_best([(0.0, 50.0), (0.5, 70.0), (1.0, 60.0), (1.5, 80.0)]) == \
        [(0.0, 50.0), (0.5, 70.0), (1.0, 70.0), (1.25, 70.0), (1.5, 80.0)]
    late = budget.envelope([[(0.0, 40.0), (0.5, 60.0)], [(0.4, 70.0), (0.8, 71.0)]])
    assert budget.curve_at(late, 0.39) == pytest.approx(40.0 + 20.0 * 0.39 / 0.5)
    assert budget.steps_to_reach(late, 65.0) == pytest.approx(0.4)
    # probes of several runs at one compute: the best of them
    assert budget.curve_at(budget.envelope([[(0.0, 30.0), (0.1, 50.0)], [(0.0, 30.0), (0.1, 57.0), (0.2, 60.0)]]),
                           0.1) == pytest.approx(57.0)

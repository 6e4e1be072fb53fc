"""benchmarks/timm_kd.py, the study against timm's own distillation: what each run's steps cost, how a method is read
at another's compute, the sentence that says who leads; and, with -m slow, the study end to end on a few hundred
images."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from scripts import load_script  # noqa: E402

kd = load_script("benchmarks/timm_kd.py", "_timm_kd_for_tests")


def test_a_cached_runs_steps_are_priced_by_lambda_and_the_precompute_is_counted_once():
    class A:
        train_size = 100

    timing = {"precompute_per_image": {"seconds": 0.01, "cpu_seconds": 0.02},
              "kinds": {"plain": {"seconds": 1.0, "cpu_seconds": 1.5}, "timm": {"seconds": 3.0, "cpu_seconds": 4.0},
                        "cached_lambda1": {"seconds": 2.0, "cpu_seconds": 2.5},
                        "cached_mixed": {"seconds": 5.0, "cpu_seconds": 6.0}}}
    run = {"lambda_per_step": [1.0, 1.0, 0.5, 0.0, 0.0], "unit": ["cached", 5, 0]}
    assert kd.step_kinds("cached_decay", run) == ["cached_lambda1"] * 2 + ["cached_mixed"] + ["plain"] * 2
    assert kd.compute(A, "cached", run, timing) == {"side_by_side": 1.0 + 2 * 2.0 + 5.0 + 2 * 1.0,
                                                    "cpu": 2.0 + 2 * 2.5 + 6.0 + 2 * 1.5}
    timm_run = {"lambda_per_step": None, "unit": ["timm", 3, 0]}
    assert kd.compute(A, "timm", timm_run, timing) == {"side_by_side": 9.0, "cpu": 12.0}


def test_a_method_is_read_off_its_own_curve_and_not_beyond_it():
    points = [(10.0, 50.0), (30.0, 70.0)]
    assert kd.interpolate(points, 10.0) == 50.0
    assert kd.interpolate(points, 20.0) == pytest.approx(60.0)
    assert kd.interpolate(points, 30.0) == 70.0
    assert kd.interpolate(points, 5.0) is None and kd.interpolate(points, 31.0) is None


def cell(*per_seed):
    values = [v for v in per_seed if v is not None]
    return {"mean": sum(values) / len(values) if values else None, "sd": 0.1, "per_seed": list(per_seed)}


def test_the_verdict_counts_a_lead_only_where_every_seed_has_it():
    budgets = {"50": {"plain": {"top1": cell(40, 41)}, "timm": {"top1": cell(38, 39)}, "cached": {"top1": cell(39, 40)},
                      "cached_decay": {"top1": cell(30, 31)}},
               "100": {"plain": {"top1": cell(50, 49)}, "timm": {"top1": cell(52, 48)}, "cached": {"top1": cell(45, 50)},
                       "cached_decay": {"top1": cell(53, 47)}}}
    point = {"top1": {"plain": cell(41, 42), "timm": cell(37, 38), "cached": cell(39, 40),
                      "cached_decay": cell(None, 40)}}
    an = {"budgets": budgets, "equal": {"side_by_side": [point], "cpu": [point]}}
    text = kd.verdict(an, ["plain", "timm", "cached", "cached_decay"])
    assert ("under the switch schedule, against timm's online distillation: at equal steps ahead at 1, behind at 0 "
            "and split across the seeds at 1 of 2 budgets; at equal side-by-side wall-clock ahead at 1, behind at 0 and "
            "split across the seeds at 0 of 1 points") in text
    assert ("under the decay schedule, against timm's online distillation: at equal steps ahead at 0, behind at 1 and "
            "split across the seeds at 1 of 2 budgets; at equal side-by-side wall-clock ahead at 0, behind at 0 and "
            "split across the seeds at 0 of 0 points") in text
    # budget 100: plain 50 vs the best distillation 53 on seed 0, 49 vs 50 on seed 1: behind on both
    assert ("Plain supervised training, against the best distillation of each seed: ahead at 1, behind at 1 and split "
            "across the seeds at 0 of 2 budgets") in text


def test_the_results_file_renders_every_block_the_choosing_page_places():
    result = json.loads((ROOT / "benchmarks" / "results" / "timm_kd.json").read_text())
    blocks = kd.tables(result)
    page = (ROOT / "docs" / "choosing.md").read_text()
    assert {f"timm_kd.{name}" for name in blocks} | {"timm_kd.figure"} <= set(
        line.split("generated: ")[1].split(" ")[0] for line in page.splitlines() if "<!-- generated: timm_kd." in line)
    assert len(result["analysis"]["seeds"]) >= 3 and len(result["settings"]["budgets"]) >= 3
    assert all(r["commit"] == result["runs"][next(iter(result["runs"]))]["commit"] for r in result["runs"].values())


@pytest.mark.slow
def test_the_study_end_to_end_on_a_few_hundred_images(tmp_path):
    pytest.importorskip("timm")
    out = tmp_path / "results" / "timm_kd.json"
    kd.main(["--budgets", "4", "8", "--seeds", "0", "--train-size", "256", "--test-size", "256", "--timing-steps", "2",
             "--cache", str(tmp_path / "cache"), "--runs", str(tmp_path / "runs"), "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["analysis"]["budgets"]["8"]) == set(kd.METHODS)
    assert out.with_suffix(".png").is_file()
    cached = result["runs"]["cached-8-seed0"]["lambda_per_step"]
    assert cached[0] == 1.0 and cached[-1] == 0.0  # the default: lambda 1, then the hand-over inside the run
    assert 0.0 < result["runs"]["cached_decay-8-seed0"]["lambda_per_step"][0] < 1.0

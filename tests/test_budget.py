"""The accuracy-at-budget study (benchmarks/budget.py) on a tiny grid: outputs, caching, resume, methods."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


budget = _load("budget")

TINY = ["--grid", "tiny", "--seeds", "0", "--steps", "5", "--batch-size", "32", "--train-size", "256",
        "--test-size", "200", "--probe-epochs", "2", "--prior-steps-same", "2", "--prior-steps-cross", "2",
        "--switch-timing-steps", "2", "--threads", "1", "--workers", "1", "--no-progress"]


def _run(tmp_path, *extra):
    argv = TINY + ["--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), *extra]
    args = budget.build_parser().parse_args(argv)
    args.argv = argv
    return budget.run(args)


def _cell_files(tmp_path):
    return {p.name: p.read_text() for p in (tmp_path / "cache" / "cells").glob("*.json")}


def test_tiny_grid_outputs_cache_and_resume(tmp_path):
    n_cells = len(budget.make_grid(budget.build_parser().parse_args(TINY)))
    # an interrupted study: only 2 of the cells get computed
    first = _run(tmp_path, "--max-new-cells", "2")
    assert first["cells_computed_this_run"] == 2 and not first["complete"]
    assert first["cells_missing"] == n_cells - 2
    before = _cell_files(tmp_path)
    assert len(before) == 2
    # resume (with 2 worker processes sharing the cache): the 2 cached cells are re-used unchanged
    second = _run(tmp_path, "--workers", "2")
    assert second["cells_computed_this_run"] == n_cells - 2 and second["complete"]
    after = _cell_files(tmp_path)
    assert len(after) == n_cells and all(after[k] == v for k, v in before.items())
    # a third invocation computes nothing and reports the same numbers
    third = _run(tmp_path)
    assert third["cells_computed_this_run"] == 0
    assert [c["linear_top1"] for c in third["cells"]] == [c["linear_top1"] for c in second["cells"]]

    out = json.loads((tmp_path / "out" / "budget.json").read_text())
    png = tmp_path / "out" / "budget_accuracy.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for cell in out["cells"]:
        assert 0.0 <= cell["linear_top1"] <= 100.0 and 0.0 <= cell["knn_top1"] <= 100.0
        assert cell["wall_seconds"] > 0 and cell["steps"] == max(1, round(cell["fraction"] * 5))
    table = out["tables"]["paper001_table2_linear"]
    assert table.splitlines()[0].startswith("| budget | BYOL | +ReLA random prior")
    assert "20 % steps" in table and "20 % data / epoch" in table
    g = out["goals"]
    assert set(g) >= {"best_prior", "rela_20pct_steps_reaches_plain_100pct", "rela_beats_plain_every_budget_le_50pct",
                      "switch_ssl_free_phase_saves_time"}
    goal1 = g["rela_20pct_steps_reaches_plain_100pct"]
    assert goal1["pass"] == (goal1["rela_20pct"] >= goal1["plain_100pct"])
    assert g["switch_ssl_free_phase_saves_time"]["median_seconds_plain_step"] > 0
    # the Switch cell starts with lambda == 1 (SSL loss skipped) and records those steps' times
    sw = next(c for c in out["cells"] if c["schedule"] == "switch")
    assert sw["lambda_first"] == 1.0 and sw["steps_lambda_1"] >= 1
    # a changed setting is a different cell (cache key covers every setting)
    cell = budget.make_grid(budget.build_parser().parse_args(TINY))[0]
    s = budget.shared_settings(budget.build_parser().parse_args(TINY))
    assert budget.cell_key(cell, 0, s) != budget.cell_key(cell, 1, s)
    assert budget.cell_key(cell, 0, s) != budget.cell_key(cell, 0, {**s, "lr": 3e-3})


@pytest.mark.parametrize("method", ["byol", "simclr", "barlowtwins", "vicreg", "simsiam", "moco", "dino"])
def test_every_method_trains_two_steps_with_rela(method):
    args = budget.build_parser().parse_args(["--batch-size", "16", "--widths", "8", "16", "--threads", "1", "--no-progress"])
    images = torch.randn(64, 1, 28, 28)
    torch.manual_seed(3)
    init, _ = budget.make_backbone(args)
    targets = torch.randn(64, 10)
    backbone, log = budget.train_ssl(args, images, 2, seed=3, method=method, targets=targets, schedule="constant:0.5")
    assert len(log["step_seconds"]) == 2 and log["lambda"] == [0.5, 0.5]
    changed = any(not torch.equal(a, b) for a, b in zip(init.state_dict().values(), backbone.state_dict().values()))
    assert changed, f"{method}: two steps did not change the backbone"


def test_bad_settings_have_clear_errors():
    parser = budget.build_parser()
    with pytest.raises(ValueError, match="raise --train-size or lower --batch-size"):
        budget.check_args(parser.parse_args(["--train-size", "500"]))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use --device cpu"):
            budget.check_args(parser.parse_args(["--device", "cuda"]))
    with pytest.raises(ValueError, match="unknown"):
        budget.check_args(parser.parse_args(["--methods", "swav2"]))
    with pytest.raises(ValueError, match="Unknown schedule 'cosine'; use 'decay', 'switch', 'constant:<lambda>'"):
        budget.create_schedule("cosine", total_steps=10)


def test_resnet18_student_runs_one_step_with_convnet_prior_targets():
    args = budget.build_parser().parse_args(["--backbone", "resnet18", "--batch-size", "4", "--threads", "1", "--no-progress"])
    backbone, log = budget.train_ssl(args, torch.randn(8, 1, 28, 28), 1, seed=0, targets=torch.randn(8, 16))
    assert backbone(torch.randn(2, 1, 28, 28)).shape == (2, 512) and len(log["step_seconds"]) == 1
    assert budget.shared_settings(args)["prior_widths"] == [16, 32, 64]  # the ConvNet priors are part of the key


def test_plain_cells_are_shared_across_rela_recipes_and_rela_cells_are_not():
    parser = budget.build_parser()
    a = parser.parse_args([])
    b = parser.parse_args(["--same-prior", "train", "--main-schedule", "switch", "--rela-views", "weak", "--components", "16",
                           "--prior-steps-same", "50"])
    plain = {"method": "byol", "prior": "none", "schedule": "none", "kind": "steps", "fraction": 0.2, "subset": "full"}
    same = {**plain, "prior": "same", "schedule": "switch"}
    sa, sb = budget.shared_settings(a), budget.shared_settings(b)
    assert budget.cell_key(plain, 0, sa) == budget.cell_key(plain, 0, sb)
    assert budget.cell_key(same, 0, sa) != budget.cell_key(same, 0, sb)
    grid = budget.make_grid(b)
    assert {c["schedule"] for c in grid if c["group"] == "main" and c["prior"] != "none"} == {"switch"}
    assert {c["schedule"] for c in grid if c["group"] == "controller"} == {"decay", "constant:0.5"}


def test_switch_with_weak_views_and_few_components_skips_ssl_loss_first():
    args = budget.build_parser().parse_args(["--batch-size", "16", "--widths", "8", "16", "--threads", "1", "--no-progress"])
    _, log = budget.train_ssl(args, torch.randn(64, 1, 28, 28), 3, seed=0, targets=torch.randn(64, 10),
                              schedule="switch", rela_views="weak", components=4)
    assert log["lambda"][0] == 1.0 and len(log["step_seconds"]) == 3

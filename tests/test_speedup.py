"""The speed-up study (benchmarks/speedup.py) on a tiny grid: units, resume, the demo's runs as units, the speed-ups
recomputed from the recorded curves, and the tables regenerated from its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from scripts import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
study = load_script("benchmarks/speedup.py", "speedup")

TINY = ["--seeds", "0", "--full-steps", "4", "--plain-probes", "0", "2", "4", "--train-size", "256",
        "--test-size", "128", "--probe-epochs", "2", "--batch-size", "32", "--widths", "8", "16", "--timing-steps", "2"]


def test_tiny_study_resumes_imports_the_demo_and_regenerates_its_tables(tmp_path, capsys, fashion_mnist_available):
    from accelerate_ssl.cli import main as cli_main
    from accelerate_ssl.recipes import cost_speedup

    # the demo's own runs (same recipe and settings) are units of the study: its plain curve is not trained again
    assert cli_main(["demo", "--budget", "2", "--plain-multiple", "2", "--probes", "1", "--train-size", "256",
                     "--test-size", "128", "--batch-size", "32", "--probe-epochs", "2", "--widths", "8", "16",
                     "--prior", "shipped:digits-byol", "--out", str(tmp_path / "demo"), "--json"]) == 0
    demo = json.loads((tmp_path / "demo" / "demo.json").read_text())
    paths = ["--cache", str(tmp_path / "cache"), "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "s.json")]
    argv = [*TINY, "--cells", "random:2", "digits:2", "--compare", "digits:2", *paths,
            "--demo-json", str(tmp_path / "demo" / "demo.json")]
    assert study.main(argv) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    runs = sorted(p.name for p in (tmp_path / "runs").glob("*.json"))
    assert runs == ["rela-digits-2-two-view-0.json", "rela-random-2-one-view-0.json", "timing-digits.json"]
    assert result["plain"]["per_seed"]["0"] == demo["plain"]["curve"]  # imported, bit for bit
    cells = result["cells"]
    assert set(cells) == {"digits|2|one-view", "digits|2|two-view", "random|2|one-view"}
    assert cells["digits|2|one-view"]["top1"] == demo["rela_top1"]
    # the demo's prior costs here the precompute the demo paid; another prior, the study's own
    assert cells["digits|2|two-view"]["precompute"]["seconds"] == demo["targets"]["precompute"]["seconds"]
    assert "imported_from" not in cells["random|2|one-view"]["precompute"]
    for c in cells.values():  # wall-clock speed-up = plain's seconds to ReLA's accuracy / (ReLA's seconds + precompute)
        p = c["per_seed"][0]
        assert c["precompute"]["seconds"] > 0
        assert p["wall"] == cost_speedup(demo["plain"]["curve"], p["top1"], p["train_seconds"] + c["precompute"]["seconds"])
        assert p["step_time_ratio"] > 0
    kinds = result["timing"]["kinds"]
    assert set(kinds) == {"plain", "one-view", "two-view", "online"} and all(k["median_step_seconds"] > 0 for k in kinds.values())
    assert all(len(u["load_average_start"]) == 3 for u in result["units"].values())
    # resume: nothing is computed again, the numbers are the same
    capsys.readouterr()
    assert study.main(argv) == 0
    assert "5 of 5 units done; 0 to run" in capsys.readouterr().out
    again = json.loads((tmp_path / "s.json").read_text())
    assert again["cells"] == result["cells"]
    # the tables come from the JSON alone
    assert study.main(["--tables", str(tmp_path / "s.json")]) == 0
    assert capsys.readouterr().out.strip() == result["table"].strip()
    assert "| `shipped:digits-byol`" in result["table"] and "online" in result["table"]


def test_a_cell_that_is_not_prior_colon_steps_is_refused(capsys):
    import pytest

    for bad in (["--cells", "digits"], ["--cells", "nope:100"], ["--cells", "digits:many"], ["--compare", "digits:1:2"]):
        with pytest.raises(SystemExit):
            study.parse_args(bad)
        assert "cells are PRIOR:STEPS" in capsys.readouterr().err

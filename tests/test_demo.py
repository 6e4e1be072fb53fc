"""accelerate-ssl demo: the speed-up arithmetic, and the whole demo end to end on tiny settings."""

import json
import struct
from pathlib import Path

import pytest
import torch

from accelerate_ssl import demo
from accelerate_ssl.cli import main as cli_main
from accelerate_ssl.recipes import cost_speedup, speedup


# ---------------------------------------------------------------------------------------------- arithmetic
def test_probe_steps_include_zero_budget_and_end():
    assert demo.probe_steps(100, 400, 4) == [0, 25, 50, 75, 100, 125, 150, 175, 200, 225, 250, 275, 300, 325, 350, 375, 400]
    assert demo.probe_steps(250, 1000, 2)[:4] == [0, 125, 250, 375] and demo.probe_steps(250, 1000, 2)[-1] == 1000
    assert demo.probe_steps(3, 3, 4) == [0, 1, 2, 3]


@pytest.mark.parametrize("spec, cls, value", [("decay", "Decay", 0.8), ("switch", "Switch", 1.0),
                                              ("constant:0.3", "Constant", 0.3), ("epochs:0.5", "Epochs", 1.0)])
def test_parse_schedule_scales_to_budget(spec, cls, value):
    s = demo.parse_schedule(spec, budget=200)
    assert type(s).__name__ == cls and s.value == pytest.approx(value)
    if cls == "Epochs":
        assert s.switch_step == 100


@pytest.mark.parametrize("flags, words", [
    (["--schedule", "cosine"], ["--schedule", "decay"]),
    (["--budget", "0"], ["--budget", "positive"]),
    (["--plain-multiple", "0.5"], ["--plain-multiple", ">= 1"]),
    (["--batch-size", "64", "--train-size", "32"], ["--batch-size", "lower"]),
    (["--components", "-1"], ["--components", ">= 0"]),
    (["--seeds", "1", "1"], ["--seeds", "distinct"]),
    (["--device", "gpu0"], ["--device 'gpu0'", "'cpu' or 'cuda'"]),
    (["--device", "meta"], ["--device 'meta'", "'cpu' or 'cuda'"]),
])
def test_bad_arguments_name_the_problem_and_the_fix(tmp_path, flags, words):
    with pytest.raises(ValueError) as err:
        cli_main(["demo", "--out", str(tmp_path), *flags])
    for w in words:
        assert w in str(err.value)


def test_device_cuda_on_a_machine_without_one_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device 'cuda': torch sees no CUDA device here .* --device cpu"):
        cli_main(["demo", "--out", str(tmp_path), "--device", "cuda"])


# ---------------------------------------------------------------------------------------------- end to end
def _png_size(path: Path) -> tuple[int, int]:
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", raw[16:24])


def _check_outputs(out: Path, stdout: str, budget: int, plain_steps: int) -> dict:
    assert "| steps | plain BYOL top-1 % | ReLA top-1 % | lambda |" in stdout
    assert "speed-up in wall-clock:" in stdout and "in CPU time:" in stdout and "in steps:" in stdout
    w, h = _png_size(out / "demo.png")
    assert w > 300 and h > 300
    result = json.loads((out / "demo.json").read_text())
    plain_steps_seen = [c["step"] for c in result["plain"]["curve"]]
    rela_steps_seen = [c["step"] for c in result["rela"]["curve"]]
    assert plain_steps_seen[0] == 0 and plain_steps_seen[-1] == plain_steps and budget in plain_steps_seen
    assert rela_steps_seen[0] == 0 and rela_steps_seen[-1] == budget
    assert len(result["rela"]["lambda_per_step"]) == budget
    for c in result["plain"]["curve"] + result["rela"]["curve"]:
        assert 0.0 <= c["top1"] <= 100.0
    # the reported numbers are the measured ones, and the speed-up follows from them
    assert result["rela_top1"] == result["rela"]["curve"][-1]["top1"]
    recomputed = speedup([(c["step"], c["top1"]) for c in result["plain"]["curve"]], result["rela_top1"], budget)
    assert recomputed == result["speedup"]
    # wall-clock: plain's training seconds to ReLA's accuracy / (ReLA's training seconds + the precompute)
    rela_cost = result["rela"]["curve"][-1]["train_seconds"] + result["targets"]["precompute"]["seconds"]
    assert result["speedup_wall"] == cost_speedup(result["plain"]["curve"], result["rela_top1"], rela_cost)
    assert result["targets"]["precompute"]["seconds"] > 0 and result["speedup_wall"]["cost_rela"] > rela_cost - 1e-9
    assert result["step_time_ratio"] > 0 and result["speedup_cpu"]["cost_rela"] > 0
    assert len(result["machine"]["load_average_start"]) == 3 and len(result["machine"]["load_average_end"]) == 3
    assert result["machine"]["cpu_capability"] and result["machine"]["torch_threads"] == 1
    assert result["table"] in stdout
    assert result["command"].startswith("accelerate-ssl")
    assert result["machine"]["cpu_count"] >= 1
    return result


def test_demo_tiny_end_to_end(tmp_path, capsys, fashion_mnist_available):
    out = tmp_path / "demo"
    flags = ["demo", "--budget", "4", "--plain-multiple", "2", "--probes", "2", "--train-size", "256",
             "--test-size", "128", "--batch-size", "32", "--probe-epochs", "2", "--widths", "8", "16",
             "--prior", "random:convnet", "--out", str(out)]
    assert cli_main(flags) == 0
    result = _check_outputs(out, capsys.readouterr().out, budget=4, plain_steps=8)
    assert result["targets"]["rows"] == 256
    assert result["settings"]["prior_spec"] == "random:convnet"
    assert result["machine"]["device"] == "cpu" and result["machine"]["gpu"] is None
    # a second run re-uses the cached targets and, seeded, measures exactly the same numbers; --json ends the output
    # with one JSON object holding the speed-up it wrote to demo.json
    assert cli_main([*flags, "--json"]) == 0
    stdout = capsys.readouterr().out
    assert "targets: re-using" in stdout
    again = json.loads((out / "demo.json").read_text())
    printed = json.loads(stdout.strip().splitlines()[-1])
    assert printed["speedup"] == again["speedup"] and printed["rela_top1"] == again["rela_top1"]
    # the precompute's cost is recorded once and counted again by the run that re-uses the store
    assert again["targets"]["precompute"] == result["targets"]["precompute"]
    assert [c["top1"] for c in again["rela"]["curve"]] == [c["top1"] for c in result["rela"]["curve"]]
    assert [c["top1"] for c in again["plain"]["curve"]] == [c["top1"] for c in result["plain"]["curve"]]
    # --weights as on every verb: other weights for the same spec never re-use those targets
    from accelerate_ssl.backbones import ConvNet

    torch.manual_seed(123)
    torch.save(ConvNet(1).state_dict(), tmp_path / "w.pt")
    assert cli_main([*flags, "--weights", str(tmp_path / "w.pt"), "--json"]) == 0
    assert "targets: re-using" not in capsys.readouterr().out
    weighted = json.loads((out / "demo.json").read_text())
    assert weighted["prior"]["weights_sha256"] and weighted["targets"]["path"] != again["targets"]["path"]


def test_demo_several_seeds_reports_mean_curves_and_each_speedup(tmp_path, capsys, fashion_mnist_available):
    out = tmp_path / "demo"
    flags = ["demo", "--budget", "4", "--plain-multiple", "2", "--probes", "1", "--train-size", "256",
             "--test-size", "128", "--batch-size", "32", "--probe-epochs", "2", "--widths", "8", "16",
             "--prior", "random:convnet", "--seeds", "0", "1", "--out", str(out)]
    assert cli_main(flags) == 0
    stdout = capsys.readouterr().out
    result = _check_outputs(out, stdout, budget=4, plain_steps=8)
    assert [r["seed"] for r in result["per_seed"]] == [0, 1]
    for key in ("plain", "rela"):
        curves = [r[key]["curve"] for r in result["per_seed"]]
        assert curves[0] != curves[1]  # the seeds are different runs
        for k, point in enumerate(result[key]["curve"]):
            accs = [c[k]["top1"] for c in curves]
            assert point["top1"] == pytest.approx(sum(accs) / 2)
            assert point["top1_std"] == pytest.approx(abs(accs[0] - accs[1]) / 2)
    for r in result["per_seed"]:
        assert r["speedup"] == speedup([(c["step"], c["top1"]) for c in r["plain"]["curve"]], r["rela_top1"], 4)
        assert f"seed {r['seed']}: wall-clock {r['speedup_wall']['text']}; steps {r['speedup']['text']}" in stdout
    assert "(mean of 2 seeds)" in stdout and " ± " in result["table"]


def test_rela_run_differs_from_plain_only_by_the_wrap(tmp_path, fashion_mnist_available):
    """Same seed: both runs start from the same weights and see the same batches; with lambda = 0 for
    good (constant:0) ReLA must give exactly the plain BYOL numbers."""
    import argparse

    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.recipes import Probe, images_to_tensor

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--budget", "3", "--train-size", "128", "--batch-size", "32", "--widths", "8", "16",
                              "--schedule", "constant:0", "--probe-epochs", "1"])
    train = FashionMNIST("train", limit=128)
    test = FashionMNIST("test", limit=64)
    train.transform = demo._uint8_tensor
    probe = Probe(images_to_tensor(train.data), train.targets, images_to_tensor(test.data), test.targets, epochs=1, seed=0)
    targets = torch.randn(128, 16)
    a = demo.train_byol(args, train, probe, 3, [3], store=targets, seed=0)
    b = demo.train_byol(args, train, probe, 3, [3], seed=0)
    assert a["curve"][0]["top1"] == b["curve"][0]["top1"]
    assert a["lambda_per_step"] == [0.0, 0.0, 0.0]


def test_default_prior_ships_and_loads():
    from accelerate_ssl.priors import create_prior

    from accelerate_ssl.priors import shipped_prior_file

    # a prior trained on other data (digits), label-free: a user's situation, not an upper bound; small enough to ship
    assert demo.DEFAULT_PRIOR == "shipped:digits-byol"
    assert shipped_prior_file("digits-byol").stat().st_size < 10 * 2**20
    assert "other data" in demo.PRIOR_TRAINING[demo.DEFAULT_PRIOR]
    prior = create_prior(demo.DEFAULT_PRIOR)
    assert prior.describe()["family"] == "shipped" and len(prior.describe()["checkpoint_sha256"]) == 64
    x = torch.randint(0, 256, (2, 1, 28, 28), dtype=torch.uint8)
    y = prior(prior.preprocess.batch(x))
    assert y.shape == (2, prior.output_dim) and torch.isfinite(y).all()


@pytest.mark.slow
def test_demo_defaults(tmp_path, capsys, fashion_mnist_available):
    """The real thing: defaults, real Fashion-MNIST (minutes)."""
    out = tmp_path / "demo"
    assert cli_main(["demo", "--out", str(out)]) == 0
    result = _check_outputs(out, capsys.readouterr().out, budget=250, plain_steps=1000)
    assert result["rela_top1"] > result["plain_top1_at_budget"]


def test_the_prediction_interval_is_students_on_the_logs():
    """exp(m +- t(0.975, n-1) * s * sqrt(1 + 1/n)) over log speed-ups, the quantiles Student's (checked against scipy)."""
    import math
    import statistics

    from scipy import stats

    for df, t in demo.T_975.items():
        assert t == pytest.approx(stats.t.ppf(0.975, df), abs=6e-4), df
    values = [4.03, 3.54, 3.62, 3.1, 4.4, 1.5]
    logs = [math.log(v) for v in values]
    half = stats.t.ppf(0.975, 5) * statistics.stdev(logs) * (7 / 6) ** 0.5
    expected = (math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half))
    assert demo.prediction_interval(values) == pytest.approx(expected, rel=1e-3)
    lo, hi = demo.prediction_interval([2.0, 8.0])  # symmetric around the geometric mean, 4
    assert lo * hi == pytest.approx(16.0) and lo > 0
    for bad in ([3.0], [3.0, 0.0]):
        with pytest.raises(ValueError, match="2 to 20 positive"):
            demo.prediction_interval(bad)


def test_a_run_is_placed_in_the_reference_interval_only_for_its_settings(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    defaults = parser.parse_args([])
    result = {"speedup_cpu": {"speedup": 3.0}}
    assert set(demo.REFERENCE) >= {"seeds", "speedup_cpu", "mean_cpu", "speedup_steps", "machine"}  # it ships
    monkeypatch.setattr(demo, "REFERENCE", None)
    assert "not measured" in demo._reference_line(defaults, result)
    monkeypatch.setattr(demo, "REFERENCE", {"seeds": [0, 1, 2], "speedup_cpu": [2.5, 3.5, 3.0], "mean_cpu": 3.03,
                                            "speedup_steps": [3.0, 4.0, 3.5], "machine": "the 2-core VM"})
    lo, hi = demo.prediction_interval([2.5, 3.5, 3.0])
    line = demo._reference_line(defaults, result)
    assert (f"3.00x, inside the 95 % interval {lo:.2f}-{hi:.2f}x (above 1 of the 3 seeds, which gave 2.50-3.50x)"
            in line)
    assert "below the 95 % interval" in demo._reference_line(defaults, {"speedup_cpu": {"speedup": lo * 0.99}})
    assert "above the 95 % interval" in demo._reference_line(defaults, {"speedup_cpu": {"speedup": hi * 1.01}})
    line = demo._reference_line(defaults, {"speedup_cpu": {"speedup": 3.0}, "speedup": {"speedup": 8.0}})
    assert "in steps: 8.00x, above the 95 % interval" in line and "above 3 of the 3 seeds" in line
    assert "these differ" in demo._reference_line(parser.parse_args(["--threads", "2"]), result)
    assert "these differ" in demo._reference_line(parser.parse_args(["--prior", "random:convnet"]), result)
    assert "on the CPU only (this run is on cuda)" in demo._reference_line(parser.parse_args(["--device", "cuda"]), result)
    # seeds, output folder and --json do not change the numbers of a seed
    assert "inside" in demo._reference_line(parser.parse_args(["--seeds", "0", "1", "--json", "--out", "x"]), result)


def test_the_shipped_reference_is_the_committed_measurement():
    """REFERENCE is what benchmarks/results/demo.json measured with the default settings, not a number typed apart."""
    import argparse

    result = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "demo.json").read_text())
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    assert {k: result["settings"][k] for k in demo.NUMERIC_SETTINGS} == {k: defaults[k] for k in demo.NUMERIC_SETTINGS}
    assert len(result["per_seed"]) >= 3
    assert demo.REFERENCE["seeds"] == [r["seed"] for r in result["per_seed"]]
    assert demo.REFERENCE["speedup_cpu"] == [round(r["speedup_cpu"]["speedup"], 2) for r in result["per_seed"]]
    assert demo.REFERENCE["speedup_steps"] == [round(r["speedup"]["speedup"], 2) for r in result["per_seed"]]
    assert demo.REFERENCE["mean_cpu"] == round(result["speedup_cpu"]["speedup"], 2)
    # the file's own reference line is the one the demo writes against REFERENCE (seeds, intervals), from its numbers
    args = argparse.Namespace(**{**defaults, **result["settings"]})
    assert result["reference"] == demo._reference_line(args, result)
    assert result["reference"].startswith(f"reference: seeds {', '.join(map(str, demo.REFERENCE['seeds']))} on ")


@pytest.mark.parametrize("prior_spec", ["shipped:digits-byol", "timm:vit_small_patch14_dinov2.lvd142m",
                                        "checkpoint:/home/someone/runs/2026-11-20/prior-weights-after-20000-steps.pt"])
def test_the_figure_title_fits_inside_the_figure(prior_spec, monkeypatch, tmp_path):
    """The title, as the renderer lays it out (every line), lies inside the saved figure: the committed measurement's
    and one with a long prior spec."""
    result = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "demo.json").read_text())
    result["settings"]["prior_spec"] = prior_spec
    figures = []
    monkeypatch.setattr(demo, "save_figure", lambda fig, path, dpi=110: figures.append(fig))
    demo.write_png(result, tmp_path / "demo.png")
    fig = figures[0]
    fig.canvas.draw()
    title = fig.axes[0].title
    extent = title.get_window_extent(fig.canvas.get_renderer())
    text = title.get_text()
    assert prior_spec in text.replace("\n", "") and text.replace("\n", " ").endswith("(mean ± std of 6 seeds)")
    assert 0 <= extent.x0 and extent.x1 <= fig.bbox.width and extent.y1 <= fig.bbox.height, (extent, fig.bbox)

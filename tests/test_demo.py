"""accelerate-ssl demo: the README's recipe against plain BYOL at equal compute, its arithmetic, and the whole demo end
to end on tiny settings."""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from accelerate_ssl import demo
from accelerate_ssl.cli import main as cli_main
from accelerate_ssl.recipes import steps_to_reach, value_at


# ---------------------------------------------------------------------------------------------- arithmetic
def test_probe_steps_include_zero_budget_and_end():
    assert demo.probe_steps(100, 400, 4) == [0, 25, 50, 75, 100, 125, 150, 175, 200, 225, 250, 275, 300, 325, 350, 375, 400]
    assert demo.probe_steps(250, 1000, 2)[:4] == [0, 125, 250, 375] and demo.probe_steps(250, 1000, 2)[-1] == 1000
    assert demo.probe_steps(3, 3, 4) == [0, 1, 2, 3]


@pytest.mark.parametrize("spec, cls, value", [(None, "Switch", 1.0), ("decay", "Decay", 0.8), ("switch", "Switch", 1.0),
                                              ("constant:0.3", "Constant", 0.3), ("epochs:0.5", "Epochs", 1.0)])
def test_parse_schedule_plans_for_the_budget(spec, cls, value):
    from accelerate_ssl.schedules import SWITCH_END_FRACTION

    s = demo.parse_schedule(spec, budget=200)
    assert type(s).__name__ == cls and s.value == pytest.approx(value)
    if cls == "Epochs":
        assert s.switch_step == 100
    if cls == "Switch":  # the library's default, planned as ReLA(total_steps=200) plans it
        assert s.ends_by == round(SWITCH_END_FRACTION * 200)


def test_compare_reads_both_curves_at_equal_compute():
    """ReLA's end against plain's curve at the same seconds (precompute counted in ReLA's), and the seconds at which
    ReLA's curve first reaches plain's end, as a fraction of plain's."""
    plain = {"curve": [{"step": s, "top1": a, "train_cpu_seconds": t, "train_seconds": 2 * t}
                       for s, a, t in [(0, 40.0, 0.0), (10, 60.0, 10.0), (20, 70.0, 20.0)]]}
    rela = {"curve": [{"step": s, "top1": a, "train_cpu_seconds": t, "train_seconds": 2 * t}
                      for s, a, t in [(0, 40.0, 0.0), (10, 66.0, 4.0), (20, 74.0, 8.0)]]}
    pre = {"cpu_seconds": 2.0, "seconds": 3.0}
    c = demo.compare(plain, rela, pre, "cpu")
    assert c["rela_seconds"] == 10.0 and c["compute_fraction"] == 0.5 and c["rela_top1"] == 74.0
    assert c["plain_top1_at_equal_compute"] == 60.0 and c["gain"] == 14.0  # plain at 10 CPU s
    assert c["seconds_to_plain"] == pytest.approx(6.0 + 4.0 * (70 - 66) / (74 - 66))  # between ReLA's 6 and 10 s
    assert c["compute_to_plain"] == pytest.approx(c["seconds_to_plain"] / 20.0)
    w = demo.compare(plain, rela, pre, "wall")
    assert w["rela_seconds"] == 19.0 and w["unit"] == "s"
    never = demo.compare(plain, {"curve": rela["curve"][:2]}, pre, "cpu")
    assert never["compute_to_plain"] is None and never["seconds_to_plain"] is None
    assert value_at([(0.0, 1.0), (2.0, 3.0)], 1.0) == 2.0 and steps_to_reach([(0, 1.0), (2, 3.0)], 2.0) == 1.0


@pytest.mark.parametrize("flags, words", [
    (["--schedule", "cosine"], ["--schedule", "switch"]),
    (["--budget", "0"], ["--budget", "positive"]),
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


def _check_outputs(out: Path, stdout: str, budget: int) -> dict:
    assert "| run | step | CPU s | lambda | top-1 % |" in stdout
    assert "CPU time: ReLA ended at" in stdout and "wall-clock: ReLA ended at" in stdout
    w, h = _png_size(out / "demo.png")
    assert w > 300 and h > 300
    result = json.loads((out / "demo.json").read_text())
    for key in ("plain", "rela"):
        steps = [c["step"] for c in result[key]["curve"]]
        assert steps[0] == 0 and steps[-1] == budget
    assert len(result["rela"]["lambda_per_step"]) == budget
    for c in result["plain"]["curve"] + result["rela"]["curve"]:
        assert 0.0 <= c["top1"] <= 100.0
    # the reported comparison is the one the measured curves give
    for clock in ("cpu", "wall"):
        assert result[clock] == demo.compare(result["plain"], result["rela"], result["targets"]["precompute"], clock)
    assert result["cpu"]["rela_top1"] == result["rela"]["curve"][-1]["top1"]
    assert result["targets"]["precompute"]["cpu_seconds"] > 0
    assert len(result["machine"]["load_average_start"]) == 3 and len(result["machine"]["load_average_end"]) == 3
    assert result["machine"]["cpu_capability"] and result["machine"]["torch_threads"] == 1
    assert result["table"] in stdout and result["reference"]["text"] in stdout
    assert result["command"].startswith("accelerate-ssl")
    return result


def test_demo_tiny_end_to_end(tmp_path, capsys, fashion_mnist_available):
    from accelerate_ssl.schedules import DEFAULT_SCHEDULE

    out = tmp_path / "demo"
    flags = ["demo", "--budget", "8", "--probes", "2", "--train-size", "256", "--test-size", "128", "--batch-size", "32",
             "--probe-epochs", "2", "--widths", "8", "16", "--prior", "random:convnet", "--out", str(out)]
    assert cli_main(flags) == 0
    result = _check_outputs(out, capsys.readouterr().out, budget=8)
    assert result["targets"]["rows"] == 256 and result["settings"]["prior_spec"] == "random:convnet"
    assert result["machine"]["device"] == "cpu" and result["machine"]["gpu"] is None
    # the README's recipe: the library's default schedule, recorded as such; lambda 1 first, then BYOL
    assert result["default"] is True and result["schedule"] == DEFAULT_SCHEDULE
    lam = result["rela"]["lambda_per_step"]
    assert lam[0] == 1.0 and lam[-1] == 0.0
    # the finished seed's runs were saved: run again, the demo re-uses them (an interrupted multi-seed demo resumes)
    assert cli_main(flags) == 0
    assert "seed 0: re-using its two finished runs" in capsys.readouterr().out
    assert json.loads((out / "demo.json").read_text())["cpu"] == result["cpu"]
    # without them, a second run re-uses the cached targets and, seeded, measures exactly the same accuracies; --json
    # ends the output with one JSON object holding the comparison it wrote to demo.json
    shutil.rmtree(out / "runs")
    assert cli_main([*flags, "--json"]) == 0
    stdout = capsys.readouterr().out
    assert "targets: re-using" in stdout and "finished runs" not in stdout
    again = json.loads((out / "demo.json").read_text())
    printed = json.loads(stdout.strip().splitlines()[-1])
    assert printed["cpu"] == again["cpu"] and printed["default"] is True
    assert again["targets"]["precompute"] == result["targets"]["precompute"]  # recorded once, counted again
    assert [c["top1"] for c in again["rela"]["curve"]] == [c["top1"] for c in result["rela"]["curve"]]
    assert [c["top1"] for c in again["plain"]["curve"]] == [c["top1"] for c in result["plain"]["curve"]]
    # another schedule is not the README's recipe, and says so
    assert cli_main([*flags, "--schedule", "decay", "--json"]) == 0
    capsys.readouterr()
    other = json.loads((out / "demo.json").read_text())
    assert other["rela"]["lambda_per_step"] != lam  # other settings: the saved runs were not re-used
    assert other["default"] is False and other["schedule"] == "decay"
    # --weights as on every verb: other weights for the same spec never re-use those targets
    from accelerate_ssl.backbones import ConvNet

    torch.manual_seed(123)
    torch.save(ConvNet(1).state_dict(), tmp_path / "w.pt")
    assert cli_main([*flags, "--weights", str(tmp_path / "w.pt"), "--json"]) == 0
    assert "targets: re-using" not in capsys.readouterr().out
    weighted = json.loads((out / "demo.json").read_text())
    assert weighted["prior"]["weights_sha256"] and weighted["targets"]["path"] != again["targets"]["path"]


def test_demo_several_seeds_reports_mean_curves_and_each_seed(tmp_path, capsys, fashion_mnist_available):
    out = tmp_path / "demo"
    flags = ["demo", "--budget", "6", "--probes", "2", "--train-size", "256", "--test-size", "128", "--batch-size", "32",
             "--probe-epochs", "2", "--widths", "8", "16", "--prior", "random:convnet", "--seeds", "0", "1",
             "--out", str(out)]
    assert cli_main(flags) == 0
    stdout = capsys.readouterr().out
    result = _check_outputs(out, stdout, budget=6)
    assert [r["seed"] for r in result["per_seed"]] == [0, 1] == [r["seed"] for r in result["runs"]]
    for key in ("plain", "rela"):
        curves = [r[key]["curve"] for r in result["runs"]]
        assert curves[0] != curves[1]  # the seeds are different runs
        for k, point in enumerate(result[key]["curve"]):
            accs = [c[k]["top1"] for c in curves]
            assert point["top1"] == pytest.approx(sum(accs) / 2)
            assert point["top1_std"] == pytest.approx(abs(accs[0] - accs[1]) / 2)
    for r, run in zip(result["per_seed"], result["runs"]):
        assert r["cpu"] == demo.compare(run["plain"], run["rela"], result["targets"]["precompute"], "cpu")
        assert f"seed {r['seed']}: gain at equal CPU time" in stdout
    assert "(the mean curves of 2 seeds)" in stdout and " ± " in result["table"]


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
    told = demo.prior_training(demo.DEFAULT_PRIOR)  # from its training record, not typed
    record = json.loads((demo.REFERENCE_FILE.parents[1] / demo.PRIOR_RECORDS[demo.DEFAULT_PRIOR][0]).read_text())
    assert "other data" in told and f"{record['steps']:,} training steps" in told
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
    result = _check_outputs(out, capsys.readouterr().out, budget=1000)
    assert result["default"] is True and result["cpu"]["gain"] > 0


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


def _reference_file(tmp_path, fractions, gains, settings=None):
    import argparse

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    ref = {"settings": {**defaults, **(settings or {})}, "machine": {"torch": "2.14.1", "cpu_capability": "AVX512"},
           "per_seed": [{"seed": i, "cpu": {"compute_to_plain": f, "gain": g}} for i, (f, g) in
                        enumerate(zip(fractions, gains))]}
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(ref))
    return path, parser


def test_a_run_is_placed_among_the_reference_seeds_only_for_their_settings(monkeypatch, tmp_path):
    path, parser = _reference_file(tmp_path, [0.3, 0.4, 0.35], [2.0, 3.0, 2.5])
    monkeypatch.setattr(demo, "REFERENCE_FILE", path)
    defaults = parser.parse_args([])
    result = {"cpu": {"compute_to_plain": 0.36, "gain": 2.2}, "machine": {"torch": "2.14.1", "cpu_capability": "AVX512"}}
    lo, hi = demo.prediction_interval([0.3, 0.4, 0.35])
    ref = demo.reference(defaults, result)
    assert ref["compute_to_plain"]["where"] == "inside" and ref["seeds"] == [0, 1, 2]
    assert (f"compute to plain's accuracy 0.36, inside the 95 % interval {lo:.2f}-{hi:.2f} of the 3 reference seeds "
            "(0.30-0.40)") in ref["text"] and "gain at equal compute +2.20 points (reference seeds +2.00 to +3.00)" in ref["text"]
    assert demo.reference(defaults, {**result, "cpu": {"compute_to_plain": lo * 0.9, "gain": 2.0}})["compute_to_plain"][
        "where"] == "below"
    assert "another setup" in demo.reference(defaults, {**result, "machine": {"torch": "2.15", "cpu_capability": "AVX2"}})["text"]
    assert "these differ" in demo.reference(parser.parse_args(["--threads", "2"]), result)["text"]
    assert "these differ" in demo.reference(parser.parse_args(["--prior", "random:convnet"]), result)["text"]
    assert "on the CPU only" in demo.reference(parser.parse_args(["--device", "cuda"]), result)["text"]
    # seeds, output folder and --json do not change the numbers of a seed
    assert "inside" in demo.reference(parser.parse_args(["--seeds", "0", "1", "--json", "--out", "x"]), result)["text"]
    # a reference measured with other settings is not used; none at all is said so
    path, _ = _reference_file(tmp_path, [0.3, 0.4], [1.0, 2.0], settings={"budget": 500})
    assert "rerun it" in demo.reference(defaults, result)["text"]
    monkeypatch.setattr(demo, "REFERENCE_FILE", tmp_path / "missing.json")
    assert "none here" in demo.reference(defaults, result)["text"]


def test_the_committed_reference_is_the_default_recipe_measured_per_seed():
    """benchmarks/results/demo.json, which the demo places a run against: the default settings, the README's recipe
    (``"default": true``), several seeds, and its reference text the one the demo writes from its own numbers."""
    import argparse

    result = json.loads(demo.REFERENCE_FILE.read_text())
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    assert {k: result["settings"][k] for k in demo.NUMERIC_SETTINGS} == {k: defaults[k] for k in demo.NUMERIC_SETTINGS}
    assert result["default"] is True and len(result["per_seed"]) >= 5
    args = argparse.Namespace(**{**defaults, **result["settings"], "seeds": [0]})
    mine = {k: result[k] for k in ("cpu", "machine")}
    assert demo.reference(args, mine)["text"] == result["reference"]["text"]


@pytest.mark.parametrize("prior_spec", ["shipped:digits-byol", "timm:vit_small_patch14_dinov2.lvd142m",
                                        "checkpoint:/home/someone/runs/2026-11-20/prior-weights-after-20000-steps.pt"])
def test_the_figure_title_fits_inside_the_figure(prior_spec, monkeypatch, tmp_path):
    """The title, as the renderer lays it out, lies inside the saved figure: the committed measurement's and one with a
    long prior spec."""
    result = json.loads(demo.REFERENCE_FILE.read_text())
    result["settings"]["prior_spec"] = prior_spec
    figures = []
    monkeypatch.setattr(demo, "save_figure", lambda fig, path, dpi=110: figures.append(fig))
    demo.write_png(result, tmp_path / "demo.png")
    fig = figures[0]
    fig.canvas.draw()
    title = fig.axes[0].title
    extent = title.get_window_extent(fig.canvas.get_renderer())
    assert prior_spec in title.get_text().replace("\n", "")
    assert 0 <= extent.x0 and extent.x1 <= fig.bbox.width and extent.y1 <= fig.bbox.height, (extent, fig.bbox)

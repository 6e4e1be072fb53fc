"""The examples run end to end with tiny settings and print what they promise."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from processes import cpu_process_env

ROOT = Path(__file__).resolve().parents[1]


def _run(script, args, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=tmp_path, env=cpu_process_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _lambdas(out):
    return [float(m) for m in re.findall(r"lambda (\d\.\d+)", out)]


def test_plain_byol_example(tmp_path, fashion_mnist_available):
    out = _run("plain_byol.py", ["--steps", "6", "--limit", "256", "--probe-limit", "200", "--batch-size", "32",
                                  "--log-every", "2", "--store", str(tmp_path / "store")], tmp_path)
    lams = _lambdas(out)
    assert len(lams) == 3 and lams[0] <= 0.8 and lams[-1] <= lams[0]
    m = re.search(r"linear probe top-1 ([\d.]+)%", out)
    assert m and 10.0 < float(m.group(1)) <= 100.0  # better than chance on 10 classes
    assert (tmp_path / "store" / "metadata.json").exists()


def test_supervised_example(tmp_path, fashion_mnist_available):
    out = _run("supervised.py", ["--steps", "6", "--limit", "256", "--test-limit", "200", "--batch-size", "32",
                                  "--log-every", "2", "--store", str(tmp_path / "store"), "--schedule", "switch"], tmp_path)
    lams = _lambdas(out)  # Switch scaled to 6 steps: ReLA stage (lambda 1), then cross-entropy only (0)
    assert len(lams) == 3 and lams[0] == 1.0 and lams[-1] == 0.0
    assert re.search(r"test top-1 ([\d.]+)%", out)


def test_supervised_example_learns_the_classes(tmp_path, fashion_mnist_available):
    # decay keeps some cross-entropy from the first step (lambda <= 0.8), so the classifier trains: 40 steps of
    # batch 32 reach ~37 % on 500 test images (chance: 10 %; the switch run above trains only the ReLA term first)
    out = _run("supervised.py", ["--steps", "40", "--limit", "512", "--test-limit", "500", "--batch-size", "32",
                                  "--log-every", "10", "--store", str(tmp_path / "store")], tmp_path)  # the default: decay
    assert float(re.search(r"test top-1 ([\d.]+)%", out).group(1)) > 25.0


def test_distilled_warmstart_example(tmp_path, fashion_mnist_available):
    out = _run("distilled_warmstart.py", ["--ipc", "1", "--iterations", "2", "--main-steps", "2",
                                           "--out", str(tmp_path / "distilled")], tmp_path)
    assert re.search(r"^10 images in ", out, re.M), out  # one image per class of Fashion-MNIST
    manifest = __import__("json").loads((tmp_path / "distilled" / "manifest.json").read_text())
    assert manifest["method"] == "dwa" and manifest["ipc"] == 1
    m = re.search(r"after 2 steps of the main loop: warm-started ([\d.]+) vs from scratch ([\d.]+)", out)
    assert m, out
    assert all(0.0 <= float(v) <= 1.0 for v in m.groups())


def test_compact_pretraining_example(tmp_path, fashion_mnist_available):
    store = tmp_path / "c.safetensors"
    out = _run("compact_pretraining.py", ["--n-real", "300", "--steps", "1", "--epochs", "1", "--pool-max-steps", "2",
                                           "--out", str(store)], tmp_path)
    assert store.is_file()
    m = re.search(r"CompactDataset\(kind='basis', m=(\d+), floats=(\d+)\)", out)
    assert m and int(m.group(2)) <= 100 * 28 * 28  # within the storage budget of 100 images
    assert f"decoded pairs: ({4 * int(m.group(1))}, 1, 28, 28) ({4 * int(m.group(1))}, 128)" in out  # X_s + 3 rotations
    acc = float(re.search(r"linear probe on the compact-pretrained student: ([\d.]+)%", out).group(1))
    assert 20.0 < acc <= 100.0  # far above chance (10 %) on 10 classes

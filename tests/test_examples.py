"""The examples run end to end with tiny settings and print what they promise."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script, args, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
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
    m = re.search(r"test top-1 ([\d.]+)%", out)
    assert m and 0.0 <= float(m.group(1)) <= 100.0

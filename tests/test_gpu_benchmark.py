"""``benchmarks/gpu.py --smoke``: the GPU benchmark's whole command rehearsed on the CPU at toy sizes, so that a lent
GPU's minutes go to measuring, not to debugging. Every section must run to the end without an error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from processes import cpu_process_env

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("tests", "precompute", "steps", "no_host_sync", "study", "compiled")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, fashion_mnist_available):
    out, work = tmp_path_factory.mktemp("gpu-out"), tmp_path_factory.mktemp("gpu-work")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--out", str(out),
                           "--work", str(work)], cwd=ROOT, env=cpu_process_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "gpu_smoke.json").read_text()), out, done.stdout


def test_every_section_runs_without_an_error(smoke):
    result, out, stdout = smoke
    assert result["size"] == "smoke" and not result["skipped"]
    for name in SECTIONS:
        assert name in result and "error" not in result[name], (name, result.get(name))
    assert result["tests"]["passed"] and (out / "pytest_cuda.log").is_file()
    assert (out / "gpu_smoke.png").is_file() and (out / "demo_gpu.json").is_file()
    assert "FAILED" not in stdout


def test_every_step_kind_is_timed_and_held_against_the_cost_model(smoke):
    result, _, _ = smoke
    kinds = result["steps"]["kinds"]
    assert set(kinds) == {"plain", "rela_mixed", "rela_lambda1", "rela_lambda1_one_view", "plain_loader",
                          "rela_mixed_host_prefetch", "online_teacher:dinov2_vit_s14", "online_teacher:dinov2_vit_b14",
                          "plain_again"}
    assert all(v["step_s"] > 0 for v in kinds.values()), kinds
    rows = result["cost_model"]["rows"]
    assert {"rela_mixed", "rela_lambda1_one_view", "precompute_image:dinov2_vit_b14"} <= set(rows)
    assert all(r["measured_time"] > 0 and r["error"] is not None for r in rows.values())
    for name, prior in result["precompute"]["priors"].items():
        assert prior["precompute_img_per_s"] > 0 and prior["input_pipeline_img_per_s"] > 0, name


def test_the_compiled_steps_capture_the_features(smoke):
    """Both compiled kinds ran their ReLA wrap (a student whose features were not captured raises at wrap)."""
    result, _, _ = smoke
    assert all("step_s" in v for v in result["compiled"]["kinds"].values()), result["compiled"]


def test_the_study_is_the_demo_on_that_device(smoke):
    result, out, _ = smoke
    demo = json.loads((out / "demo_gpu.json").read_text())
    assert demo["machine"]["device"] == "cpu" and demo["settings"]["budget"] == 4
    assert result["study"]["mean"]["rela_train_seconds"] > 0

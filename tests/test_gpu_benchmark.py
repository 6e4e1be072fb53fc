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
sys.path.insert(0, str(ROOT / "benchmarks"))
SECTIONS = ("tests", "precompute", "steps", "budget", "no_host_sync", "study", "compiled")
PRIORS = ("dinov2_vit_s14", "dinov2_vit_b14")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, fashion_mnist_available):
    out, work = tmp_path_factory.mktemp("gpu-out"), tmp_path_factory.mktemp("gpu-work")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--out", str(out),
                           "--work", str(work), "--sections", *SECTIONS, "--steps", "plain_loader",
                           "rela_mixed_host_prefetch"], cwd=ROOT, env=cpu_process_env(PYTHONPATH=str(ROOT)),
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
    for key in ("commit", "device", "driver", "torch", "cuda", "cudnn"):  # what every GPU result records
        assert key in result, key
    assert len(result["commit"]) == 40


def test_the_default_run_is_the_gpu_rounds_sections():
    import gpu

    assert gpu.DEFAULT_SECTIONS == ["tests", "precompute", "steps", "budget"]
    assert sum(gpu.ESTIMATE_S[s] for s in gpu.DEFAULT_SECTIONS) + gpu.MARGIN_S <= gpu.SIZES["full"].budget_s <= 480
    assert "tests/test_precompute_inputs.py" in gpu.CUDA_TESTS


def test_every_step_kind_is_timed_like_for_like_and_held_against_the_cost_model(smoke):
    result, _, _ = smoke
    kinds = result["steps"]["kinds"]
    like_for_like = {f"{kind}:{p}" for p in PRIORS for kind in ("rela_lambda1_one_view", "online_teacher_one_view",
                                                                  "rela_lambda1", "online_teacher")}
    assert set(kinds) == {"plain", "rela_mixed", "plain_loader", "rela_mixed_host_prefetch", "plain_again",
                          *like_for_like}
    assert all(v["step_s"] > 0 for v in kinds.values()), kinds
    assert all(set(result["steps"]["rela_over_online"][p]) == {"one_view", "two_views"} for p in PRIORS)
    rows = result["cost_model"]["rows"]
    assert {"rela_mixed", "rela_lambda1_one_view:dinov2_vit_s14", "precompute_image:dinov2_vit_b14"} <= set(rows)
    assert all(r["measured_time"] > 0 and r["error"] is not None for r in rows.values())


def test_the_precompute_is_measured_three_ways_on_a_folder_and_an_array(smoke):
    result, _, _ = smoke
    for name in PRIORS:
        for data in ("folder", "array"):
            row = result["precompute"]["priors"][name][data]
            for key in ("bare_forward_img_s", "input_pipeline_img_s", "precompute_img_s"):
                assert row[key] > 0, (name, data, key)
            assert row["ratio"] == pytest.approx(row["precompute_img_s"] / row["bare_forward_img_s"], rel=1e-2)
            assert 0 < row["pipeline_share"] < 1
            assert row["loader"]["reads"] == ("files" if data == "folder" else "array")
            assert {"read", "row_digest", "fingerprint", "preprocess"} <= set(row["parts_us_per_image"])
        assert "decode" in result["precompute"]["priors"][name]["folder"]["parts_us_per_image"]


def test_the_budget_place_runs_another_scripts_argv_and_reads_its_json(tmp_path):
    """Where the budget study goes: another script's argv, run in a child process, its JSON read back, its time
    bounded."""
    import gpu

    script = tmp_path / "study.py"
    script.write_text("import json, sys\nout = sys.argv[sys.argv.index('--out') + 1]\n"
                      "open(out, 'w').write(json.dumps({'argv': sys.argv[1:]}))\nprint('done')\n")
    done = gpu.run_script(script, ["--seeds", "2", "--out", str(tmp_path / "study.json")], tmp_path, 60)
    assert done["returncode"] == 0 and done["json"]["argv"][:2] == ["--seeds", "2"]
    assert (tmp_path / "study.log").read_text().strip() == "done"
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(30)\n")
    stopped = gpu.run_script(slow, [], tmp_path, 1)
    assert stopped["returncode"] is None and "stopped after" in (tmp_path / "slow.log").read_text()


def test_the_compiled_steps_capture_the_features(smoke):
    """Both compiled kinds ran their ReLA wrap (a student whose features were not captured raises at wrap)."""
    result, _, _ = smoke
    assert all("step_s" in v for v in result["compiled"]["kinds"].values()), result["compiled"]


def test_the_study_is_the_demo_on_that_device(smoke):
    result, out, _ = smoke
    demo = json.loads((out / "demo_gpu.json").read_text())
    assert demo["machine"]["device"] == "cpu" and demo["settings"]["budget"] == 4
    assert demo["default"] is True and result["study"]["default"] is True  # the README's recipe
    assert result["study"]["mean"]["rela_seconds"] > 0 and result["study"]["mean"]["plain_seconds"] > 0

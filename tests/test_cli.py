import json
import subprocess
import sys

import pytest

from accelerate_ssl.cli import COMMANDS, main


def _help(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0, argv
    return capsys.readouterr().out


#: every verb (and sub-verb) -> options its help must list: the shared grammar (--data, --prior, --out, --seed, --json)
VERBS = {
    ("priors",): ["--json"],
    ("precompute",): ["--prior", "--weights", "--data", "--out", "--json"],
    ("store",): ["verify"],
    ("store", "verify"): ["--json"],
    ("demo",): ["--prior", "--out", "--seed", "--json"],
    ("distill",): ["--data", "--weights", "--seed", "--out", "--json"],
    ("compact",): ["distill", "info"],
    ("compact", "distill"): ["--data", "--images", "--seed", "--out"],
    ("compact", "info"): [],
}


def test_every_verb_and_sub_verb_has_a_help_that_lists_the_shared_options(capsys):
    assert {v[0] for v in VERBS} == set(COMMANDS)
    for argv, options in VERBS.items():
        out = _help(capsys, list(argv))
        assert argv[-1] in out
        for option in options:
            assert option in out, (argv, option)


def test_no_command_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_import_is_light():
    code = "import sys, accelerate_ssl; print(any(m in sys.modules for m in ('timm', 'open_clip', 'lightly')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ------------------------------------------------------------------------------------------ one result per launch
def _folder_of_images(root, n=12):
    import numpy as np
    from PIL import Image

    (root / "a").mkdir(parents=True)
    for i in range(n):
        Image.fromarray(np.random.RandomState(i).randint(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / "a" / f"{i}.png")
    return root


def test_precompute_under_accelerate_launch_prints_its_result_once(tmp_path):
    """Every process of `accelerate launch` runs the verb (each computes its shard); the store is one, so is its line."""
    from pathlib import Path

    from processes import assert_exited_cleanly, cpu_process_env

    data = _folder_of_images(tmp_path / "imgs")
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    root = str(Path(__file__).resolve().parents[1])
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "-m", "accelerate_ssl.cli", "precompute", "--prior", "random:convnet",
           "--data", f"folder:{data}", "--out", str(tmp_path / "store"), "--no-progress"]
    env = cpu_process_env(PYTHONPATH=root)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert_exited_cleanly(done.returncode, done.stderr, env=env)
    wrote = [line for line in done.stdout.splitlines() if line.startswith("wrote ")]
    assert wrote == [f"wrote {tmp_path / 'store'}: 12 rows x 256 (random:convnet, fp32)"], done.stdout
    assert json.loads((tmp_path / "store" / "metadata.json").read_text())["num_processes"] == 2  # both ran it


def test_every_verb_prints_its_result_on_the_main_process_only(tmp_path, capsys, monkeypatch):
    """The rule is cli.main's, for every verb: stdout (the result) on rank 0 only, stderr (errors) on every rank."""
    data = _folder_of_images(tmp_path / "imgs")
    assert main(["precompute", "--prior", "random:convnet", "--data", str(data), "--out", str(tmp_path / "s"),
                 "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("wrote ")
    for rank, printed in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        assert main(["store", "verify", str(tmp_path / "s"), "--no-progress"]) == 0
        assert len(capsys.readouterr().out.splitlines()) == printed, rank
        assert main(["priors", "show", "random:convnet", "--json"]) == 0
        out = capsys.readouterr().out
        assert (out == "") if rank == "1" else json.loads(out)["spec"] == "random:convnet", rank
    monkeypatch.setenv("RANK", "1")
    assert main(["store", "verify", str(tmp_path / "missing")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "store verify: error" in err  # a process's own error still says why it failed

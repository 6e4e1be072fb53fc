import json

import pytest
import torch

from accelerate_ssl.cli import main
from accelerate_ssl.compact import CompactDataset, load_teacher, save_teacher, train_teacher
from accelerate_ssl.compact.teacher import TEACHER_VIEWS
from accelerate_ssl.recipes import random_views


@pytest.mark.parametrize("method", ["barlow_twins", "byol"])
def test_train_teacher_standardize_save_load(tmp_path, method):
    images = torch.randn(40, 1, 12, 12)
    teacher = train_teacher(images, method=method, steps=2, batch_size=8, widths=(4, 8), progress=False)
    assert teacher.output_dim == 8 and not any(p.requires_grad for p in teacher.parameters())
    teacher.standardize(images)
    out = teacher(images)
    torch.testing.assert_close(out.mean(0), torch.zeros(8), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.std(0), torch.ones(8), atol=1e-3, rtol=0)
    loaded = load_teacher(str(save_teacher(teacher, tmp_path / "t.safetensors")))
    assert torch.equal(loaded(images), out) and loaded.describe()["method"] == method
    with pytest.raises(FileNotFoundError, match="train_teacher"):
        load_teacher(str(tmp_path / "missing.safetensors"))


def test_random_views_are_random_and_shaped():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1, 12, 12)
    a, b = random_views(x, TEACHER_VIEWS, g), random_views(x, TEACHER_VIEWS, g)
    assert a.shape == x.shape and not torch.equal(a, b)
    again = torch.Generator().manual_seed(0)
    assert torch.equal(random_views(x, TEACHER_VIEWS, again), a)  # a seeded generator gives the same views


def test_cli_distill_and_info(tmp_path, capsys):
    out = tmp_path / "c.safetensors"
    rc = main(["compact", "distill", "--data", "digits", "--limit", "80", "--train-teacher", "barlow_twins",
               "--teacher-steps", "1", "--images", "3", "--steps", "2", "--real-batch", "16", "--pool-size", "2",
               "--pool-max-steps", "2", "--pool-width", "4", "--pool-depth", "2", "--scale", "4", "--U", "6", "--V", "6", "--m", "20",
               "--approx-hidden", "2", "--out", str(out)])
    assert rc == 0 and out.exists()
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(printed["approx_unexplained"]) == 3  # the fit quality of each rotation's approximation net
    compact = CompactDataset.load(out)
    assert compact.num_floats <= 3 * 28 * 28 and compact.metadata["preprocessing"]["data"] == "digits"
    capsys.readouterr()
    assert main(["compact", "info", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "basis" and info["num_floats"] == compact.num_floats
    from accelerate_ssl.compact.budget import StorageBudgetError

    with pytest.raises(StorageBudgetError, match="allow-over-budget|allow_over_budget"):
        main(["compact", "distill", "--data", "digits", "--limit", "100", "--train-teacher", "byol", "--teacher-steps", "1",
              "--images", "3", "--m", "500", "--steps", "1", "--out", str(tmp_path / "x.safetensors")])

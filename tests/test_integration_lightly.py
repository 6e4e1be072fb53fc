"""lightly integration: the BYOL example differs from plain lightly BYOL by exactly the ReLA line and the
wrapped loss; it runs with and without ReLA on Fashion-MNIST; LightlyDataset folders work by index and
by file name."""

from __future__ import annotations

import ast
import difflib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from accelerate_ssl.data.datasets import fashion_mnist_dir
from processes import cpu_process_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lightly_byol.py"
HAVE_FMNIST = (fashion_mnist_dir() / "train-images-idx3-ubyte.gz").exists() or (fashion_mnist_dir() / "train-images-idx3-ubyte").exists()
needs_fmnist = pytest.mark.skipif(not HAVE_FMNIST, reason="Fashion-MNIST idx files not installed (apt-get install dataset-fashion-mnist)")

#: the README's commands (README section "lightly"); the tests below run exactly these.
README_WITH_RELA = "python examples/lightly_byol.py --epochs 1 --limit 256 --batch-size 64"
README_NO_RELA = "python examples/lightly_byol.py --epochs 1 --limit 256 --batch-size 64 --no-rela"
README_FOLDER = "python examples/lightly_byol.py --dataset folder:my_images --prior random:convnet --epochs 1 --batch-size 8"


# ---------------------------------------------------------------------------------------------- the diff
def strip_rela(source: str) -> str:
    """The example with ReLA removed, derived mechanically: drop the ``attach_rela`` import and the
    ``rela = ...`` statement, and replace every ``rela.wrap(X)`` by ``X`` (``rela.wrap(f, inputs=...)``, the loss as a
    function, by ``f()``)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    drop: set[int] = set()
    edits = []  # (line, col_start, col_end, replacement) for single-line rela.wrap(...) calls
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "attach_rela" for a in node.names):
            drop.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "rela" for t in node.targets):
            drop.update(range(node.lineno, node.end_lineno + 1))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "wrap"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "rela"):
            assert node.lineno == node.end_lineno and len(node.args) == 1
            arg = node.args[0]
            text = ast.get_source_segment(source, arg)
            if node.keywords:  # the loss as a function, with the view ReLA runs alone while lambda is 1
                assert [k.arg for k in node.keywords] == ["inputs"] and isinstance(arg, ast.Name)
                text += "()"
            edits.append((node.lineno, node.col_offset, node.end_col_offset, text))
    for lineno, start, end, text in sorted(edits, reverse=True):
        line = lines[lineno - 1]
        lines[lineno - 1] = line[:start] + text + line[end:]
    return "".join(line for i, line in enumerate(lines, 1) if i not in drop)


def _function(source: str, name: str) -> ast.FunctionDef:
    return next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)


def _segment(source: str, name: str) -> list[str]:
    node = _function(source, name)
    return source.splitlines()[node.lineno - 1 : node.end_lineno]


def test_training_loop_differs_from_plain_lightly_byol_only_by_the_rela_lines():
    source = EXAMPLE.read_text()
    plain = strip_rela(source)
    compile(plain, "plain_byol_from_lightly_example.py", "exec")  # the ReLA-free script is valid Python

    # 1. ReLA appears nowhere else: no 'rela'/'attach_rela' name is left in the stripped script
    names = {n.id for n in ast.walk(ast.parse(plain)) if isinstance(n, ast.Name)}
    assert not names & {"rela", "attach_rela"}
    assert "accelerate_ssl.integrations" not in plain

    # 2. the training function's diff is exactly: one added line (rela = attach_rela(...)) and the loss line
    with_rela, without = _segment(source, "main"), _segment(plain, "main")
    diff = [d for d in difflib.ndiff(without, with_rela) if d[:2] in ("- ", "+ ")]
    added = [d[2:].strip() for d in diff if d.startswith("+ ")]
    removed = [d[2:].strip() for d in diff if d.startswith("- ")]
    assert len(added) == 2 and len(removed) == 1, diff
    assert added[0].startswith("rela = attach_rela(model.backbone, dataloader")
    assert added[1] == "loss = rela.wrap(byol_loss, inputs=x0)"
    assert removed[0] == "loss = byol_loss()"
    # ... and the rest of the module (BYOL model, data, argument parsing) is identical line by line
    rest = [d for d in difflib.ndiff(plain.splitlines(), source.splitlines()) if d[:2] in ("- ", "+ ")]
    assert [d for d in rest if "attach_rela" not in d and "rela.wrap" not in d
            and d[2:].strip() != removed[0]] == [], rest

    # 3. the stripped loop has the structure of lightly's examples/pytorch/byol.py
    main = _function(plain, "main")
    calls = [ast.unparse(n.func) for n in ast.walk(main) if isinstance(n, ast.Call)]
    for needed in ("cosine_schedule", "update_momentum", "model.forward_momentum", "criterion", "loss.backward",
                   "optimizer.step", "optimizer.zero_grad", "NegativeCosineSimilarity", "BYOLTransform",
                   "BYOLView1Transform", "BYOLView2Transform", "torch.utils.data.DataLoader"):
        assert needed in calls, needed
    assert calls.count("update_momentum") == 2 and calls.count("model.forward_momentum") == 2
    loader = next(n for n in ast.walk(main) if isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.utils.data.DataLoader")
    assert {k.arg for k in loader.keywords} >= {"shuffle", "drop_last", "num_workers"}
    byol = next(n for n in ast.parse(plain).body if isinstance(n, ast.ClassDef) and n.name == "BYOL")
    byol_src = ast.unparse(byol)
    for piece in ("self.backbone =", "BYOLProjectionHead", "BYOLPredictionHead", "copy.deepcopy(self.backbone)",
                  "deactivate_requires_grad(self.backbone_momentum)", "def forward_momentum"):
        assert piece in byol_src, piece


def test_strip_rela_is_not_vacuous():
    """The stripper really removes something (guards the diff test against an example without ReLA)."""
    source = EXAMPLE.read_text()
    assert "rela = attach_rela(" in source and "rela.wrap(" in source
    assert strip_rela(source) != source


# ---------------------------------------------------------------------------------------------- runs
def _env():
    return cpu_process_env(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")


def _command(readme: str, script: Path, extra=()) -> list[str]:
    words = readme.split()
    assert words[:2] == ["python", "examples/lightly_byol.py"]
    return [sys.executable, str(script), *words[2:], *extra]


@needs_fmnist
def test_example_runs_with_and_without_rela_on_fashion_mnist(tmp_path):
    plain_script = tmp_path / "plain_lightly_byol.py"
    plain_script.write_text(strip_rela(EXAMPLE.read_text()))
    runs = {
        "rela": _command(README_WITH_RELA, EXAMPLE, ["--workers", "1", "--log-every", "1"]),
        "flag": _command(README_NO_RELA, EXAMPLE, ["--workers", "0"]),
        "stripped": _command(README_WITH_RELA, plain_script, ["--workers", "0"]),
    }
    procs = {}
    for name, cmd in runs.items():
        (tmp_path / name).mkdir()
        procs[name] = subprocess.Popen(cmd, cwd=tmp_path / name, env=_env(), text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=170)
        assert proc.returncode == 0, f"{name}: {stderr[-3000:]}"
        out[name] = stdout
    for name, stdout in out.items():
        assert "epoch: 00, loss:" in stdout, (name, stdout)
        assert np.isfinite(float(stdout.split("epoch: 00, loss:")[1].split()[0]))
    # with ReLA: targets were precomputed into the default cache folder, lambda was logged: the default schedule holds
    # it at 1 (BYOL's loss, passed as a callable, is skipped: no loss_ssl), then 0 once it has handed over to BYOL
    # inside the planned run (BYOL's loss computed and logged)
    steps = [line.split() for line in out["rela"].splitlines() if line.startswith("rela: step")]
    cheap = [s for s in steps if s[s.index("lambda") + 1] == "1.000"]
    handed = [s for s in steps if s[s.index("lambda") + 1] == "0.000"]
    assert cheap and handed and len(cheap) + len(handed) == len(steps), out["rela"]
    assert all(s[s.index("loss_ssl") + 1] == "-" for s in cheap), out["rela"]
    assert all(s[s.index("loss_ssl") + 1] != "-" for s in handed), out["rela"]
    assert len(list((tmp_path / "rela" / "rela-targets").glob("*/metadata.json"))) == 1
    # without: no ReLA output, no targets
    for name in ("flag", "stripped"):
        assert "rela:" not in out[name] and not (tmp_path / name / "rela-targets").exists()
    # the --no-rela flag and the mechanically stripped script train identically (same seed, same loop)
    assert out["flag"].split("epoch: 00, loss:")[1].split()[0] == out["stripped"].split("epoch: 00, loss:")[1].split()[0]


# ---------------------------------------------------------------------------------------------- LightlyDataset
def _image_folder(root: Path, n: int = 24, size: int = 20) -> Path:
    rng = np.random.default_rng(0)
    for i in range(n):
        cls = root / f"class{i % 2}"
        cls.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(cls / f"img{i:03d}.png")
    return root


def test_lightly_dataset_folder_lookup_by_index_and_by_filename(tmp_path):
    from lightly.data import LightlyDataset
    from lightly.transforms.byol_transform import BYOLTransform, BYOLView1Transform, BYOLView2Transform
    from torch.utils.data import DataLoader

    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.integrations.lightly import LightlyReLA, attach_rela, clean_dataset

    torch.manual_seed(0)
    folder = _image_folder(tmp_path / "images")
    views = BYOLTransform(view_1_transform=BYOLView1Transform(input_size=16, gaussian_blur=0.0),
                          view_2_transform=BYOLView2Transform(input_size=16, gaussian_blur=0.0))
    dataset = LightlyDataset(input_dir=str(folder), transform=views)
    clean = clean_dataset(dataset)
    assert clean.transform is None and dataset.transform is views  # the user's dataset is untouched
    assert len(clean) == len(dataset) and clean[0][0].size == (20, 20)

    loader = DataLoader(dataset, batch_size=8, shuffle=True, drop_last=True)
    backbone = ConvNet(in_channels=3, widths=(8, 16))
    rela = attach_rela(backbone, loader, prior="random:convnet", cache_dir=tmp_path / "targets", progress=False)
    assert isinstance(rela, LightlyReLA)
    # the file names are the store's sample keys (one key mechanism: filenames= is keys=)
    assert rela.store.keys.in_row_order() == dataset.get_filenames() == rela.filename_index.filenames

    for (x0, x1), _, fnames in loader:
        # the file names of the batch map to exactly the indices the tracked loader recorded
        assert torch.equal(rela.filename_index.rows(fnames), rela._current_index)
        f0 = backbone(x0)
        rela.wrap(torch.zeros(()), features=f0)  # the first wrap fits the head
        by_index = rela.wrap(torch.zeros(()), features=f0, index=rela._current_index)  # the tracked indices
        by_name = rela.wrap(torch.zeros(()), features=f0, filenames=fnames)
        assert torch.allclose(by_index, by_name)
        # a wrong row order gives a different loss: the lookup is not vacuous
        shuffled = rela.wrap(torch.zeros(()), features=f0, filenames=list(reversed(fnames)))
        assert not torch.allclose(by_index, shuffled)
        break

    with pytest.raises(KeyError, match="not in the target store's file list"):
        rela.filename_index.rows(["nope.png"])
    with pytest.raises(ValueError, match="not both"):
        rela.wrap(torch.zeros(()), features=f0, index=[0] * 8, filenames=fnames)

    # a second attach reuses the cached store (same folder, nothing recomputed)
    mtime = (Path(rela.store.path) / "targets.npy").stat().st_mtime_ns
    again = attach_rela(backbone, loader, prior="random:convnet", cache_dir=tmp_path / "targets", progress=False)
    assert again.store.path == rela.store.path
    assert (Path(rela.store.path) / "targets.npy").stat().st_mtime_ns == mtime


def test_example_trains_on_an_image_folder_as_lightly_dataset(tmp_path):
    folder = _image_folder(tmp_path / "my_images", n=16)
    cmd = _command(README_FOLDER, EXAMPLE, ["--workers", "0", "--log-every", "1"])
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(), text=True, capture_output=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "epoch: 00, loss:" in done.stdout and "rela: step" in done.stdout
    store = next((tmp_path / "rela-targets").glob("*/metadata.json")).parent
    from accelerate_ssl.targets.store import TargetStore

    assert len(TargetStore.open(store).keys) == len(list(folder.rglob("*.png")))


def test_other_dataset_gets_its_own_store_and_bad_datasets_are_refused(tmp_path):
    from torch.utils.data import DataLoader, Dataset

    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.data import ArrayImageDataset
    from accelerate_ssl.integrations.lightly import attach_rela, clean_dataset

    rng = np.random.default_rng(0)
    a = ArrayImageDataset(rng.integers(0, 256, (32, 12, 12), dtype=np.uint8), np.zeros(32), name="a")
    b = ArrayImageDataset(rng.integers(0, 256, (32, 12, 12), dtype=np.uint8), np.zeros(32), name="b")
    backbone = ConvNet(widths=(8,))
    with pytest.raises(ValueError, match="needs prior=.*no default"):  # no default prior that saves nothing
        attach_rela(backbone, DataLoader(a, batch_size=8), cache_dir=tmp_path, progress=False)
    ra = attach_rela(backbone, DataLoader(a, batch_size=8), prior="random:convnet", cache_dir=tmp_path, progress=False)
    rb = attach_rela(backbone, DataLoader(b, batch_size=8), prior="random:convnet", cache_dir=tmp_path, progress=False)
    assert ra.store.path != rb.store.path  # a stale cache is never reused for other data
    assert not torch.equal(ra.store[[0, 1]], rb.store[[0, 1]])
    assert attach_rela(backbone, DataLoader(a), enabled=False).wrap(torch.tensor(3.0)) == 3.0

    class NoTransform(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(1, 8, 8), 0

    with pytest.raises(TypeError, match="none of the transform attributes transform, transforms, image_transform"):
        clean_dataset(NoTransform())


def test_cifar10_missing_gives_a_clear_error(tmp_path):
    no_prior = subprocess.run([sys.executable, str(EXAMPLE), "--dataset", "cifar10", "--data-root", str(tmp_path)],
                              cwd=tmp_path, env=_env(), text=True, capture_output=True, timeout=120)
    assert no_prior.returncode != 0 and "needs --prior" in no_prior.stderr  # no default prior outside Fashion-MNIST
    done = subprocess.run([sys.executable, str(EXAMPLE), "--dataset", "cifar10", "--data-root", str(tmp_path),
                           "--prior", "random:convnet"],
                          cwd=tmp_path, env=_env(), text=True, capture_output=True, timeout=120)
    assert done.returncode != 0 and "CIFAR-10 not found" in done.stderr and "never downloads" in done.stderr

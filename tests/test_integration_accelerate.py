"""HF Accelerate integration: prepared-loader index tracking, the subset sampler under prepare, a 2-process
(gloo, CPU) run of examples/accelerate_byol.py with identical lambda and averaged loss on both processes,
resume from accelerator.save_state, the sharded precompute command, and the README's two Accelerate recipes run as
written under 2 gloo processes and counted: a script written the way Accelerate's own examples/cv_example.py is (dict
items, augmentation inside __getitem__, files in .file_names, timm's resnet50d) and one written the way its
examples/by_feature/checkpointing.py is, killed after a mid-epoch checkpoint and resumed with skip_first_batches."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from accelerate_ssl.data.datasets import fashion_mnist_dir
from accelerate_ssl.rela import ReLA
from processes import assert_exited_cleanly, cpu_process_env  # noqa: E402
from recipe_check import HOSTS, assert_every_row_is_the_samples_own, check_recipe, read_logs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "accelerate_byol.py"
RECIPES = ROOT / "tests" / "recipes"
RESUME_RECIPE = RECIPES / "accelerate_checkpointing.py"
CV_RECIPE = RECIPES / "accelerate_cv.py"
COMPLETE_RECIPE = RECIPES / "accelerate_complete_cv.py"
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
HAVE_FMNIST = any((fashion_mnist_dir() / f).exists() for f in ("train-images-idx3-ubyte.gz", "train-images-idx3-ubyte"))
needs_fmnist = pytest.mark.skipif(not HAVE_FMNIST, reason="Fashion-MNIST idx files not installed")

#: the commands of docs/hosts/accelerate.md ("BYOL under `accelerate launch`"); the tests below run exactly these.
LAUNCH = "accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no"
README_PRECOMPUTE = (f"{LAUNCH} -m accelerate_ssl.cli precompute --prior random:convnet --data fashion-mnist "
                     "--limit 512 --out rela-targets/fmnist-512")
README_TRAIN = (f"{LAUNCH} examples/accelerate_byol.py --steps 6 --limit 512 --batch-size 32 --fraction 0.25 "
                "--log-json logs --save-state ckpt --save-at 3")
README_RESUME = (f"{LAUNCH} examples/accelerate_byol.py --steps 6 --limit 512 --batch-size 32 --fraction 0.25 "
                 "--resume ckpt --log-json logs-resumed")


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    head = {"accelerate": [ACCELERATE], "python": [sys.executable]}[words[0]]
    return head + [str(ROOT / w) if w.startswith("examples/") else w for w in words[1:]]


def _env(**extra):  # the children import this checkout's package (and the recipes the tests' helpers)
    return cpu_process_env(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", **extra,
                           PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))


def _run(command: str, cwd: Path, timeout: int = 170) -> subprocess.CompletedProcess:
    return _run_argv(_argv(command), cwd, timeout)


def _run_argv(argv: list, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = _env()
    done = subprocess.run(argv, cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout)
    assert_exited_cleanly(done.returncode, done.stderr, env=env)
    return done


# ---------------------------------------------------------------------------------------------- in-process
class IndexIsLabel(Dataset):
    def __init__(self, n=40):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3,), float(i)), i


def _rela(n=40):
    return ReLA(torch.randn(n, 4), nn.Linear(3, 5), feature_dim=5)


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def test_prepared_loader_indices_match_each_yielded_batch(accelerator):
    rela = _rela()
    prepared = accelerator.prepare(DataLoader(IndexIsLabel(), batch_size=4, shuffle=True))
    loader = rela.track(prepared)
    assert len(loader) == len(prepared) == 10
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen = []
        for x, label in loader:
            # accelerate's DataLoaderShard reads one batch ahead: the naive inner tracker would be off by one
            assert torch.equal(loader.tracker.current, label) and torch.equal(rela._current_index, label)
            seen += label.tolist()
        assert sorted(seen) == list(range(40))
    # an early break, then a new epoch: still aligned
    for i, (x, label) in enumerate(loader):
        if i == 2:
            break
    for x, label in loader:
        assert torch.equal(loader.tracker.current, label)


def test_skip_first_batches_stays_aligned(accelerator):
    prepared = accelerator.prepare(DataLoader(IndexIsLabel(), batch_size=4, shuffle=False))
    skipped = accelerator.skip_first_batches(prepared, 3)
    loader = _rela().track(skipped)
    labels = []
    for x, label in loader:
        assert torch.equal(loader.tracker.current, label)
        labels.append(label)
    assert torch.cat(labels).tolist() == list(range(12, 40))


def _wrapping_rela():
    """A ReLA whose wrap takes the IndexIsLabel batch itself as the features. Its targets are random, so the statistical
    alignment check has nothing to find; these tests compare the indices ReLA uses with the batch's own."""
    return ReLA(torch.randn(40, 4), nn.Linear(3, 5), feature_dim=3, schedule="constant:1", alignment_check=False)


def _wrap_every_batch(rela, loader, epochs=2):
    """Iterate ``loader`` as a loop does, ``rela.wrap`` on every batch; the indices it used must be the batch's own."""
    seen = []
    for _ in range(epochs):
        for x, label in loader:
            rela.wrap(torch.tensor(0.0), features=x.clone().requires_grad_())
            assert torch.equal(rela._current_index, label)
            seen.append(label.tolist())
    return seen


@pytest.mark.parametrize("workers", [0, 2])
def test_prepared_loaders_with_skip_batches_publish_the_batches_they_yield(accelerator, workers):
    """Accelerate's loaders that draw k batches and yield from the k+1-th on: DataLoaderShard(skip_batches=k) reads
    one batch ahead, SkipDataLoader does not (accelerator.skip_first_batches builds them for iterable data sets; a
    map-style set gets a SkipBatchSampler instead, below). k from 1 to past the end, where a pass yields nothing."""
    from accelerate.data_loader import DataLoaderShard, SkipDataLoader

    for cls in (DataLoaderShard, SkipDataLoader):
        for k in (1, 3, 9, 10, 12):
            rela = _wrapping_rela()
            loader = rela.track(cls(IndexIsLabel(), batch_size=4, skip_batches=k, num_workers=workers))
            seen = _wrap_every_batch(rela, loader)
            assert seen == 2 * [list(range(i, i + 4)) for i in range(4 * k, 40, 4)], (cls.__name__, k)


def test_skip_first_batches_of_the_tracked_loader_is_a_prepared_loader(accelerator):
    """Given the loader rela.track returned, accelerator.skip_first_batches builds a prepared loader again (device
    placement, RNG sync, set_epoch), not a plain DataLoader; iterated through rela.track, its rows are its batches'."""
    from accelerate.data_loader import DataLoaderShard

    rela = _wrapping_rela()
    loader = rela.track(accelerator.prepare(DataLoader(IndexIsLabel(), batch_size=4)))
    skipped = accelerator.skip_first_batches(loader, 3)
    assert type(skipped) is DataLoaderShard and skipped.device == accelerator.device
    assert isinstance(loader, DataLoaderShard) and type(loader).__name__ == "TrackedLoader"
    seen = _wrap_every_batch(rela, rela.track(skipped), epochs=1)
    assert seen == [list(range(i, i + 4)) for i in range(12, 40, 4)]


def test_tracking_the_prepared_loader_every_epoch_is_one_tracked_loader(accelerator):
    """A loop that writes `for batch in rela.track(active_dataloader)` tracks the same prepared loader every epoch: one
    tracked loader (each new one would queue every batch of the prepared loader, in a FIFO nobody iterates)."""
    rela = _wrapping_rela()
    prepared = accelerator.prepare(DataLoader(IndexIsLabel(), batch_size=4, shuffle=True))
    first = rela.track(prepared)
    assert rela.track(prepared) is first and rela.track(first) is first
    for epoch in range(3):
        prepared.set_epoch(epoch)
        seen = _wrap_every_batch(rela, rela.track(prepared), epochs=1)
        assert sorted(sum(seen, [])) == list(range(40))


def test_an_untracked_skip_first_batches_loader_is_named_with_the_line_that_tracks_it(accelerator):
    """The loader accelerator.skip_first_batches returns is a new one: iterated without rela.track, wrap stops and
    names it (not "call rela.track", which the user did on the prepared loader), on a fresh ReLA and after a tracked
    pass."""
    line = "for batch in rela.track(accelerator.skip_first_batches(loader, k)):"
    rela = _wrapping_rela()
    loader = rela.track(accelerator.prepare(DataLoader(IndexIsLabel(), batch_size=4)))
    for x, _ in accelerator.skip_first_batches(loader, 2):
        with pytest.raises(RuntimeError, match="no recoverable sample indices") as err:
            rela.wrap(torch.tensor(0.0), features=x.clone().requires_grad_())
        assert "skip_first_batches returned" in str(err.value) and line in str(err.value)
        break
    _wrap_every_batch(rela, loader, epochs=1)
    for x, _ in accelerator.skip_first_batches(loader, 2):
        with pytest.raises(RuntimeError, match="no tracked loader has yielded a batch since the last wrap") as err:
            rela.wrap(torch.tensor(0.0), features=x.clone().requires_grad_())
        assert line in str(err.value)
        break
    # a prepared loader nothing tracks is named too
    for x, _ in accelerator.prepare(DataLoader(IndexIsLabel(), batch_size=4)):
        with pytest.raises(RuntimeError, match="prepared by Accelerate that rela.track has not seen"):
            rela.wrap(torch.tensor(0.0), features=x.clone().requires_grad_())
        break


def test_subset_sampler_under_prepare(accelerator):
    from accelerate_ssl.data import DynamicSubsetSampler
    from accelerate_ssl.integrations.accelerate import subset_sampler

    ds = IndexIsLabel()
    sampler = subset_sampler(ds, 0.5, seed=3)
    loader = _rela().track(accelerator.prepare(DataLoader(ds, batch_size=4, sampler=sampler)))
    for epoch in (0, 1):
        loader.set_epoch(epoch)  # reaches the DynamicSubsetSampler through accelerate's shard
        got = torch.cat([label for _, label in loader]).tolist()
        assert got == sampler.subset(epoch).tolist()
    assert sampler.subset(0).tolist() != sampler.subset(1).tolist()
    # a sampler that shards itself would be sharded twice by accelerate: refused
    twice = DynamicSubsetSampler(ds, 0.5, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="shards its batches again"):
        _rela().track(accelerator.prepare(DataLoader(ds, batch_size=4, sampler=twice)))
    plain = DataLoader(ds)
    assert _rela().track(plain) is plain  # a plain DataLoader is tracked in place


def test_rela_can_be_registered_for_checkpointing(accelerator, tmp_path):
    rela = _rela()
    accelerator.register_for_checkpointing(rela)
    try:
        rela.schedule.step(0.5)
        rela.steps = 7
        accelerator.save_state(str(tmp_path / "state"))
        want = rela.state_dict()
        rela.schedule.step(0.1)
        rela.steps = 9
        with torch.no_grad():
            rela.head.weight.add_(1.0)
        accelerator.load_state(str(tmp_path / "state"))
        got = rela.state_dict()
        assert got["steps"] == 7 and got["schedule"] == want["schedule"]
        assert torch.equal(got["head"]["weight"], want["head"]["weight"])
    finally:
        accelerator._custom_objects.remove(rela)


def test_several_priors_read_the_prepared_batchs_rows_and_are_checkpointed(accelerator, tmp_path):
    """Two priors under a prepared (read-ahead) loader: both read exactly the rows of the batch the loop holds; save_state
    / load_state restore both heads."""

    class Reads:
        def __init__(self, lookup):
            self.lookup, self.index = lookup, []

        def __call__(self, index, device):
            self.index.append(torch.as_tensor(index).clone())
            return self.lookup(index, device)

        def __getattr__(self, name):
            return getattr(self.lookup, name)

    rela = ReLA({"a": torch.randn(40, 4), "b": 10 * torch.randn(40, 6)}, nn.Linear(3, 5), feature_dim=3,
                schedule="constant:1", alignment_check=False)
    for term in rela.priors.values():
        term.targets = Reads(term.targets)
    loader = rela.track(accelerator.prepare(DataLoader(IndexIsLabel(), batch_size=4, shuffle=True)))
    labels = []
    for x, label in loader:
        rela.wrap(torch.tensor(0.0), features=x.clone().requires_grad_())
        labels.append(label)
    for term in rela.priors.values():
        assert len(term.targets.index) == 10 and all(torch.equal(i, lab) for i, lab in zip(term.targets.index, labels))
    accelerator.register_for_checkpointing(rela)
    try:
        accelerator.save_state(str(tmp_path / "state"))
        want = {n: t.head.weight.detach().clone() for n, t in rela.priors.items()}
        with torch.no_grad():
            for t in rela.priors.values():
                t.head.weight.add_(1.0)
        accelerator.load_state(str(tmp_path / "state"))
        assert all(torch.equal(t.head.weight, want[n]) for n, t in rela.priors.items())
    finally:
        accelerator._custom_objects.remove(rela)


def test_rela_track_of_a_prepared_loader_publishes_at_its_yield(accelerator):
    rela = _rela()
    prepared = accelerator.prepare(DataLoader(IndexIsLabel(), batch_size=4))
    loader = rela.track(prepared)
    assert loader is not prepared and len(loader) == len(prepared)
    for x, label in loader:
        assert torch.equal(rela._current_index, label)
    # passing the prepared loader to the constructor cannot work (it must be iterated through the wrapper)
    from accelerate_ssl.rela import ReLA

    with pytest.raises(ValueError, match="loader = rela.track"):
        ReLA(torch.randn(40, 4), nn.Linear(3, 5), feature_dim=5, dataloader=prepared)


def test_the_accelerate_recipe_is_four_added_and_three_changed_lines_of_accelerates_cv_example():
    """On the example's own timm model (no .backbone): its pooled features hooked at the classifier's input, the witness
    on the model that takes the images."""
    assert check_recipe(CV_RECIPE, "In Accelerate's own `examples/cv_example.py`", HOSTS / "accelerate.md") == (4, 3)


def test_the_accelerate_resume_recipe_is_four_added_and_two_changed_lines_of_accelerates_checkpointing_example():
    assert check_recipe(RESUME_RECIPE, "In a script written like Accelerate's `examples/by_feature/checkpointing.py`",
                        HOSTS / "accelerate.md") == (4, 2)


def test_the_two_accelerate_recipes_together_are_five_added_and_three_changed_lines_of_accelerates_complete_cv():
    """The cv_example recipe (timm's model: its pooled features at the classifier's input) and the resume recipe
    (register_for_checkpointing, the loader each epoch iterates tracked) in one script, on that same timm model."""
    assert check_recipe(COMPLETE_RECIPE, "In Accelerate's `examples/complete_cv_example.py`",
                        HOSTS / "accelerate.md") == (5, 3)


def test_from_prior_on_a_prepared_loader_and_a_clean_set_in_another_order(accelerator, tmp_path):
    """ReLA.from_prior on the loader accelerator.prepare returned (it reads ahead: checked now, iterated through
    rela.track): the targets of its dict-item data set's clean view, each batch's rows its own; given a clean set listing
    the same files in another order instead, it stops before training, naming the order."""
    from pets import PetsDataset, image_number, make_pet_images, name_number
    from torchvision.transforms import Compose, RandomResizedCrop, ToTensor

    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.targets.store import TargetStoreMismatchError

    files = make_pet_images(tmp_path / "images", 24)
    train = PetsDataset(files, image_transform=Compose([RandomResizedCrop(12, scale=(0.5, 1.0)), ToTensor()]))
    loader = accelerator.prepare(DataLoader(train, batch_size=6, shuffle=True))
    backbone = ConvNet(in_channels=3, widths=(8,))
    rela = ReLA.from_prior("random:convnet", backbone, loader, total_steps=8, cache_dir=tmp_path / "cache",
                           progress=False, image_key="image")  # (named: the field found by default is said once)
    assert rela.head is not None and rela.head.in_features == 8  # the feature dim, from the prepared loader's data
    row_of = {name_number(f): i for i, f in enumerate(files)}
    for batch in rela.track(loader):
        rela.wrap(torch.tensor(0.0), features=backbone(batch["image"]))
        assert rela._current_index.tolist() == [row_of[n] for n in image_number(batch["image"])]
    with pytest.raises(TargetStoreMismatchError, match="the same 24 files in another order"):
        ReLA.from_prior("random:convnet", backbone, loader, dataset=PetsDataset(sorted(files)),
                        cache_dir=tmp_path / "cache", progress=False, image_key="image")


def test_multi_gpu_config_file_is_one_machine_n_gpus():
    import yaml

    cfg = yaml.safe_load((ROOT / "integrations" / "accelerate_multi_gpu.yaml").read_text())
    assert cfg["distributed_type"] == "MULTI_GPU" and cfg["num_machines"] == 1 and cfg["machine_rank"] == 0
    assert cfg["gpu_ids"] == "all" and cfg["num_processes"] >= 1 and cfg["use_cpu"] is False


# ---------------------------------------------------------------------------------------------- 2 processes
@needs_fmnist
def test_sharded_precompute_command(tmp_path):
    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.targets.store import TargetStore

    _run(README_PRECOMPUTE + " --no-progress", tmp_path)
    store = TargetStore.open(tmp_path / "rela-targets" / "fmnist-512", dataset=FashionMNIST("train", limit=512))
    assert len(store) == 512 and store.metadata["num_processes"] == 2


@needs_fmnist
def test_two_process_training_and_resume(tmp_path):
    _run(README_TRAIN, tmp_path)
    logs = [json.loads((tmp_path / "logs" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [log["world"] for log in logs] == [2, 2]
    a, b = logs[0]["steps"], logs[1]["steps"]
    assert len(a) == len(b) == 6
    lambdas = [s["lambda_next"] for s in a]
    assert lambdas[-1] < lambdas[0]  # lambda really moves in this run (so "equal on both" means something)
    for x, y in zip(a, b):
        assert x["lambda"] == y["lambda"] and x["lambda_next"] == y["lambda_next"]  # same lambda every step
        assert abs(x["loss_mean"] - y["loss_mean"]) <= 1e-6  # process-averaged loss agrees
        assert x["loss"] != y["loss"]  # ... while each process's own batch loss differs
        # subset sampler under prepare: disjoint per-process batches from the epoch's common subset
        subset = set(logs[0]["epoch_subsets"][str(x["epoch"])])
        assert not set(x["index"]) & set(y["index"])
        assert set(x["index"]) | set(y["index"]) <= subset
    assert logs[0]["epoch_subsets"] == logs[1]["epoch_subsets"]
    # head gradients averaged + controller fed the averaged loss: identical ReLA state on both processes, and the same
    # backbone, bitwise, after steps where lambda was 1 and ReLA ran the backbone itself, outside the DDP wrapper
    assert a[0]["lambda"] == 1.0 and a[-1]["lambda"] < 1.0
    assert logs[0]["final"] == logs[1]["final"]
    assert logs[0]["final"]["steps"] == 6 and logs[0]["saved"]["steps"] == 3

    # resume from the accelerate checkpoint written at step 3, in the middle of epoch 1 (2 batches per epoch and
    # process): ReLA's state is restored exactly and skip_first_batches resumes with the batch step 4 trained
    _run(README_RESUME, tmp_path)
    for rank in (0, 1):
        resumed = json.loads((tmp_path / "logs-resumed" / f"rank-{rank}.json").read_text())
        assert resumed["resumed"] == logs[rank]["saved"]  # lambda, step, controller state, head weights (bitwise)
        assert [s["step"] for s in resumed["steps"]] == [4, 5, 6] and resumed["final"]["steps"] == 6
        assert [s["index"] for s in resumed["steps"]] == [s["index"] for s in logs[rank]["steps"][3:]]


def test_the_accelerate_cv_recipe_runs_as_written_and_every_row_is_the_samples_own(tmp_path):
    """The README's lines in a script written as Accelerate's cv_example.py, 2 processes: the targets of the clean view of
    its dict-item PetsDataset are made once (the processes sharing the precompute), and every row ReLA reads in training
    belongs to the image it is read for (by the image's own colour), on both processes."""
    from pets import make_pet_images

    from accelerate_ssl.targets.store import TargetStore

    make_pet_images(tmp_path / "images", 48)
    env = _env(RECIPE_LOG=str(tmp_path / "log"))
    done = subprocess.run(_argv(LAUNCH) + [str(CV_RECIPE), "--data_dir", str(tmp_path / "images"), "--cpu"],
                          cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    assert_exited_cleanly(done.returncode, done.stderr, env=env)
    ranks = read_logs(tmp_path / "log", ranks=2)
    for steps in ranks:
        assert len(steps) == 8 * 3  # 38 training images, 19 per process, batches of 8, eight epochs
        assert_every_row_is_the_samples_own(steps)
    assert [s["lambda"] for s in ranks[0]] == [s["lambda"] for s in ranks[1]]
    assert "the image is field 'image'" in done.stderr  # the choice of field is said
    stores = [p.parent for p in (tmp_path / "rela-targets").glob("*/metadata.json")]
    assert len(stores) == 1
    meta = TargetStore.open(stores[0]).metadata
    assert meta["num_processes"] == 2 and meta["dataset"]["fingerprint"]["kind"] == "files"


def _worker_images(folder: Path) -> None:
    """What tests/recipes/accelerate_checkpointing.py trains on: 48 images."""
    import numpy as np

    np.save(folder / "images.npy", np.random.default_rng(0).integers(0, 256, (48, 8, 8), dtype=np.uint8))


def _worker_steps(folder: Path) -> list[list[dict]]:
    return [[json.loads(line) for line in (folder / f"steps-{r}.jsonl").read_text().splitlines()] for r in (0, 1)]


def _kill_after_its_checkpoint(argv: list, cwd: Path, out: Path, timeout: int = 240, **env) -> None:
    """Run a recipe under ``accelerate launch`` with ``--hold`` and kill every process (SIGKILL) once it has written its
    first checkpoint and ``out/saved``: a job preempted right after it saved. Each process wrote ``out/pid-<rank>``."""
    with open(out.parent / f"{out.name}.log", "w") as log:
        run = subprocess.Popen(argv, cwd=cwd, env=_env(**env), stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + timeout
            while not (out / "saved").exists():
                assert run.poll() is None and time.monotonic() < deadline, \
                    (out.parent / f"{out.name}.log").read_text()[-4000:]
                time.sleep(0.2)
            for rank in (0, 1):
                os.kill(int((out / f"pid-{rank}").read_text()), signal.SIGKILL)
            assert run.wait(timeout=120) != 0  # the launcher saw its processes killed
        finally:
            if run.poll() is None:
                run.kill()


def test_killed_after_a_checkpoint_and_resumed_with_skip_first_batches_trains_the_uninterrupted_rows(tmp_path):
    """The README's Accelerate resume lines in a script written like Accelerate's checkpointing example, 2 gloo
    processes: killed right after the checkpoint of step 4 (mid-epoch), resumed with load_state and skip_first_batches.
    Every step reads its own samples' rows, and the killed + resumed run trains the same batches with the same losses
    as an uninterrupted one (lambda, the head and the batches all continue exactly); the first run made the targets,
    the others reopened them."""
    _worker_images(tmp_path)
    launch = [ACCELERATE, *shlex.split(LAUNCH)[1:], str(RESUME_RECIPE)]
    for name in ("whole", "killed", "resumed"):
        (tmp_path / name).mkdir()
    _run_argv(launch + ["whole"], tmp_path)

    _kill_after_its_checkpoint(launch + ["killed", "--checkpointing_steps", "4", "--hold"], tmp_path,
                               tmp_path / "killed")
    assert (tmp_path / "killed" / "saved").read_text() == "step_4"
    _run_argv(launch + ["resumed", "--resume_from_checkpoint", "killed/ckpt/step_4"], tmp_path)

    whole, killed, resumed = (_worker_steps(tmp_path / name) for name in ("whole", "killed", "resumed"))
    for rank in (0, 1):
        assert [s["step"] for s in whole[rank]] == list(range(1, 13))
        assert [s["step"] for s in killed[rank]] == [1, 2, 3, 4]
        assert [s["step"] for s in resumed[rank]] == list(range(5, 13))
        # every step reads its own samples' rows until ReLA hands over (planned for the run), none after
        for run in (whole[rank], killed[rank] + resumed[rank]):
            over = [s["handed_over"] for s in run]
            assert not over[0] and over == sorted(over) and all(s["read_is_own"] for s in run if not s["handed_over"])
        assert [s["handed_over"] for s in killed[rank] + resumed[rank]] == [s["handed_over"] for s in whole[rank]]
        assert [s["own"] for s in killed[rank] + resumed[rank]] == [s["own"] for s in whole[rank]]
        assert [s["loss"] for s in killed[rank] + resumed[rank]] == [s["loss"] for s in whole[rank]]
    for epoch in (0, 1):  # each epoch, the two processes trained the two halves of the data set
        own = [i for rank in (0, 1) for s in whole[rank] if s["epoch"] == epoch for i in s["own"]]
        assert sorted(own) == list(range(48))
    assert len(list((tmp_path / "rela-targets").glob("*/metadata.json"))) == 1


def test_the_combined_accelerate_recipe_killed_mid_epoch_and_resumed_reads_every_samples_own_row(tmp_path):
    """The two Accelerate recipes in one script written as Accelerate's complete_cv_example.py (timm's resnet50d, no
    .backbone), 2 gloo processes: killed right after the checkpoint of step 4 (mid-epoch), resumed with the example's
    own --resume_from_checkpoint (load_state, skip_first_batches). Every row ReLA reads, before the kill and after the
    resume, belongs to the image it is read for (by the image's own colour), on both processes; the resumed run
    continues at step 5 with ReLA's state (checked in the script) and the two processes' lambdas agree."""
    from pets import make_pet_images

    make_pet_images(tmp_path / "images", 48)
    launch = _argv(LAUNCH) + [str(COMPLETE_RECIPE), "--data_dir", str(tmp_path / "images"), "--cpu",
                              "--checkpointing_steps", "4"]
    for name in ("killed", "resumed"):
        (tmp_path / name).mkdir()
    _kill_after_its_checkpoint(launch + ["--output_dir", "killed", "--hold"], tmp_path, tmp_path / "killed",
                               timeout=300, RECIPE_LOG=str(tmp_path / "log-killed"))
    assert (tmp_path / "killed" / "saved").read_text() == "killed/step_4"
    done = subprocess.run(launch + ["--output_dir", "resumed", "--resume_from_checkpoint", "killed/step_4"],
                          cwd=tmp_path, env=_env(RECIPE_LOG=str(tmp_path / "log-resumed")), text=True,
                          capture_output=True, timeout=300)
    assert_exited_cleanly(done.returncode, done.stderr)
    killed, resumed = read_logs(tmp_path / "log-killed", ranks=2), read_logs(tmp_path / "log-resumed", ranks=2)
    for rank in (0, 1):
        assert [s["step"] for s in killed[rank]] == [1, 2, 3, 4]  # 19 images a process, batches of 8: 3 a epoch
        assert [s["step"] for s in resumed[rank]] == [5, 6, 7, 8, 9]  # from mid-epoch 2 to the end of epoch 3
        assert_every_row_is_the_samples_own(killed[rank] + resumed[rank])
    assert [s["lambda"] for s in killed[0] + resumed[0]] == [s["lambda"] for s in killed[1] + resumed[1]]
    assert len(list((tmp_path / "rela-targets").glob("*/metadata.json"))) == 1  # made once, reopened on resume

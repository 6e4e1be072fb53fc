import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import accelerate_ssl.targets.precompute as pc
from _precompute_worker import tiny_dataset
from accelerate_ssl.cli import main
from accelerate_ssl.priors import create_prior
from accelerate_ssl.targets.store import TargetStore
from processes import cpu_process_env  # noqa: E402

WORKER = str(Path(__file__).with_name("_precompute_worker.py"))
N, CHUNK, BATCH = 96, 16, 8  # the worker's defaults


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker processes, so runs compare bitwise
    yield
    torch.set_num_threads(before)


class RowCounter(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.rows = model, 0

    def forward(self, x):
        self.rows += len(x)
        return self.model(x)


@pytest.fixture(autouse=True)
def _on_the_cpu(monkeypatch):
    """Precompute in this file runs on the CPU, also on a GPU machine: its rows are compared bit for bit with those of
    child processes, which run on the CPU (``tests/processes.py``); precompute on CUDA is covered by test_gpu_ready.py,
    test_store.py and benchmarks/gpu.py."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _counting_prior():
    prior = create_prior("random:convnet")
    prior.model = RowCounter(prior.model)
    return prior


def _run(path, n=N, **kwargs):
    kwargs = {"batch_size": BATCH, "chunk_size": CHUNK, "progress": False, **kwargs}
    prior = _counting_prior()
    store = pc.precompute_targets(prior, tiny_dataset(n), path, **kwargs)
    return store, prior.model.rows


@pytest.fixture
def reference(tmp_path, one_thread):
    store, rows = _run(tmp_path / "reference")
    assert rows == N
    return np.array(store.array)


def _env():
    return cpu_process_env(PYTHONUNBUFFERED="1")


def test_two_processes_write_the_same_store(tmp_path, reference):
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", WORKER, str(tmp_path / "two")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    store = TargetStore.open(tmp_path / "two", dataset=tiny_dataset(N))
    assert store.metadata["num_processes"] == 2
    assert np.array_equal(np.array(store.array), reference)  # bitwise, fp32 on CPU


def test_interrupted_run_resumes_from_its_chunks(tmp_path, reference, monkeypatch):
    path = tmp_path / "resume"
    real_write, written = pc._write_chunk, []

    def failing_write(file, rows):
        if file.name.startswith("ids-"):  # a chunk's identity digests, written just before its rows
            return real_write(file, rows)
        if len(written) == 2:
            raise KeyboardInterrupt("simulated interruption after 2 chunks")
        real_write(file, rows)
        written.append(file.name)

    monkeypatch.setattr(pc, "_write_chunk", failing_write)
    with pytest.raises(KeyboardInterrupt):
        _run(path)
    assert written == ["chunk-00000.npy", "chunk-00001.npy"] and not (path / "metadata.json").exists()
    mtimes = {f: (path / "chunks" / f).stat().st_mtime_ns for f in written}
    (path / "chunks" / "chunk-00003.npy.4242.tmp").write_bytes(b"half-written")  # a crash mid-write leaves this
    with pytest.raises(ValueError, match="unfinished precompute with other settings.*precision"):
        _run(path, precision="bf16")

    rewritten = []

    def recording_write(file, rows):
        if file.name.startswith("ids-"):
            return real_write(file, rows)
        rewritten.append(file.name)
        assert mtimes.get(file.name) is None, f"{file.name} was recomputed"
        real_write(file, rows)

    monkeypatch.setattr(pc, "_write_chunk", recording_write)
    store, rows = _run(path, batch_size=4)  # the batch size is free (here bitwise the same rows)
    assert rows == N - 2 * CHUNK  # only the missing chunks were computed
    assert rewritten == [f"chunk-{k:05d}.npy" for k in range(2, N // CHUNK)]
    assert np.array_equal(np.array(store.array), reference)
    assert not (path / "chunks").exists() and not (path / "manifest.json").exists()
    again, rows = _run(path)  # finished: nothing to do
    assert rows == 0 and len(again) == N


def test_the_default_batch_size_is_the_devices(tmp_path, monkeypatch):
    sizes = []
    from accelerate_ssl.targets import write

    real = write._ChunkBatches.__init__

    def record(self, chunks, batch_size):
        sizes.append(batch_size)
        real(self, chunks, batch_size)

    monkeypatch.setattr(write._ChunkBatches, "__init__", record)
    store, rows = _run(tmp_path / "default", batch_size=None)
    assert rows == N and sizes == [write.DEFAULT_BATCH_SIZE["cpu"]] and store.metadata["batch_size"] == sizes[0]
    assert write.default_batch_size(torch.device("cuda", 0)) == write.DEFAULT_BATCH_SIZE["cuda"]
    assert write.default_batch_size("cpu") < write.DEFAULT_BATCH_SIZE["cuda"]
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        _run(tmp_path / "zero", batch_size=0)


def test_killed_process_resumes(tmp_path, reference):
    path = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, WORKER, str(path), "--sleep", "0.25"], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = path / "chunks" / "chunk-00000.npy"
    deadline = time.time() + 120
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert first.exists(), proc.stderr.read().decode()[-2000:]
    assert not (path / "metadata.json").exists(), "the run finished before it could be killed"
    with pytest.raises(ValueError, match="interrupted"):
        TargetStore.open(path)
    done = sorted(p.name for p in (path / "chunks").glob("chunk-*.npy"))
    mtime = first.stat().st_mtime_ns
    seen = []
    real_write = pc._write_chunk
    pc_write = lambda file, rows: (seen.append(file.name), real_write(file, rows))  # noqa: E731
    try:
        pc._write_chunk = pc_write
        store, rows = _run(path)
    finally:
        pc._write_chunk = real_write
    assert rows == N - len(done) * CHUNK and not set(seen) & set(done)
    assert first.exists() is False and mtime  # consolidated and cleaned up
    assert np.array_equal(np.array(store.array), reference)


class _Poison(torch.nn.Module):
    def __init__(self, model, value):
        super().__init__()
        self.model, self.value, self.calls = model, value, 0

    def forward(self, x):
        out = self.model(x).clone()
        self.calls += 1
        if self.calls == 3:  # the first batch of chunk 1: rows 16..23
            out[1] = self.value
        return out


@pytest.mark.parametrize("precision,value,hint", [("fp32", float("nan"), "weights"), ("fp16", float("inf"), "bf16 or fp32")])
def test_non_finite_rows_are_rejected(tmp_path, precision, value, hint):
    prior = create_prior("random:convnet")
    prior.model = _Poison(prior.model, value)
    with pytest.raises(ValueError, match=f"NaN/Inf features for 1 row.*indices \\[17\\].*{hint}"):
        pc.precompute_targets(prior, tiny_dataset(40), tmp_path / "bad", batch_size=8, chunk_size=16,
                              precision=precision, progress=False)
    assert sorted(p.name for p in (tmp_path / "bad" / "chunks").glob("*.npy")) == ["chunk-00000.npy", "ids-00000.npy"]


def test_bf16_is_close_to_fp32(tmp_path):
    a = np.array(pc.precompute_targets(create_prior("random:convnet"), tiny_dataset(24), tmp_path / "a",
                                       batch_size=8, progress=False).array)
    b = np.array(pc.precompute_targets(create_prior("random:convnet"), tiny_dataset(24), tmp_path / "b",
                                       batch_size=8, precision="bf16", progress=False).array)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() > 0.99 and not np.array_equal(a, b)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="precision must be one of"):
        pc.precompute_targets(create_prior("random:convnet"), tiny_dataset(4), tmp_path / "x", precision="fp8")
    with pytest.raises(ValueError, match="chunk_size"):
        pc.precompute_targets(create_prior("random:convnet"), tiny_dataset(4), tmp_path / "x", chunk_size=0)
    pc.precompute_targets(create_prior("random:convnet"), tiny_dataset(8), tmp_path / "y", progress=False)
    with pytest.raises(ValueError, match="finished store with other settings.*prior"):
        pc.precompute_targets(create_prior("random:convnet", seed=1), tiny_dataset(8), tmp_path / "y", progress=False)


def test_cli_help_bad_dataset_and_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["precompute", "--help"])
    assert exit_.value.code == 0 and "--prior" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["precompute", "--prior", "random:convnet", "--data", "cifar-10", "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2
    assert "'cifar-10' is neither a known data set nor an existing folder; use fashion-mnist, digits, folder:<path>" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["precompute", "--prior", "random:convnet", "--data", "solo:x", "--fraction", "1.5", "--out", "o"])
    assert exit_.value.code == 2 and "--fraction must be a number below 1" in capsys.readouterr().err
    assert main(["precompute", "--prior", "random:convnet", "--data", "digits", "--fraction", "0.5", "--out", "o"]) == 2
    assert "(--fraction) reproduces solo-learn's data.fraction and needs the data spec solo:<train folder> (--data solo:" \
        in capsys.readouterr().err
    assert main(["precompute", "--prior", "timm:resnet18", "--weights", str(tmp_path / "w.pth"), "--data", "digits",
                 "--split", "test", "--out", str(tmp_path / "o")]) == 2
    assert "w.pth" in capsys.readouterr().err
    out = tmp_path / "digits"
    assert main(["precompute", "--prior", "random:convnet", "--data", "digits", "--split", "test", "--out", str(out),
                 "--batch-size", "64", "--chunk-size", "100", "--no-progress"]) == 0
    from accelerate_ssl.data import Digits

    store = TargetStore.open(out, dataset=Digits("test"))
    assert len(store) == len(Digits("test")) and store.dim == 256
    assert store.metadata["command"].startswith("accelerate-ssl precompute --prior random:convnet --data digits")
    assert json.loads((out / "metadata.json").read_text())["prior"]["preprocess"]["channels"] == 1
    # the verb's former name for --data still works, and gives the same store (already finished: re-used); --json
    # prints the store's description as one JSON object
    capsys.readouterr()
    assert main(["precompute", "--prior", "random:convnet", "--dataset", "digits", "--split", "test", "--out", str(out),
                 "--batch-size", "64", "--chunk-size", "100", "--no-progress", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] == len(store) and printed["dim"] == 256 and printed["file_sha256"] == store.metadata["file_sha256"]


def test_a_store_written_before_the_descriptive_fingerprint_fields_is_still_this_computation(tmp_path):
    """Fingerprints of Subsets now also describe the subset (for mismatch messages); an existing store whose
    fingerprint lacks those fields is still recognised as the same computation, not refused."""
    import json as _json

    from torch.utils.data import Subset

    data = Subset(tiny_dataset(12), list(range(10)))
    prior = create_prior("random:convnet")
    store = pc.precompute_targets(prior, data, tmp_path / "s", progress=False)
    assert "subset" in store.metadata["dataset"]["fingerprint"]
    meta_file = tmp_path / "s" / "metadata.json"
    meta = _json.loads(meta_file.read_text())
    for key in ("subset", "base_sha256"):
        meta["dataset"]["fingerprint"].pop(key, None)
    meta_file.write_text(_json.dumps(meta))
    again = pc.precompute_targets(prior, data, tmp_path / "s", progress=False)
    assert again.array.shape == (10, store.dim)


def test_checksum_recorded_and_verify_reads_every_row(tmp_path, capsys):
    out = tmp_path / "store"
    assert main(["precompute", "--prior", "random:convnet", "--data", "digits", "--split", "test", "--out", str(out),
                 "--batch-size", "128", "--no-progress"]) == 0
    store = TargetStore.open(out)
    summary = store.verify()
    assert summary["checksum"] == "ok" and summary["rows"] == len(store)
    assert summary["sha256"] == store.metadata["file_sha256"]
    capsys.readouterr()
    assert main(["store", "verify", str(out), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    # one row damaged in place, same size: opening still works (header and size are right), verify does not
    arr = np.load(out / "targets.npy", mmap_mode="r+")
    arr[7, 3] = np.nan
    arr.flush()
    del arr
    with pytest.raises(ValueError, match="sha256 .* but metadata.json recorded .*changed on disk"):
        TargetStore.open(out).verify()
    assert main(["store", "verify", str(out), "--no-progress"]) == 1
    assert "changed on disk" in capsys.readouterr().err
    # a store written without a checksum is still checked row by row, and names the row
    meta = json.loads((out / "metadata.json").read_text())
    del meta["file_sha256"]
    (out / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"NaN/Inf values in 1 row\(s\): \[7\]"):
        TargetStore.open(out).verify()
    assert main(["store", "verify", str(tmp_path / "nowhere")]) == 1
    assert "No target store" in capsys.readouterr().err


def test_items_with_a_leading_index_or_a_list_of_views_are_refused_with_the_fix(tmp_path):
    prior = create_prior("random:convnet", in_channels=1)

    class SoloStyle(torch.utils.data.Dataset):  # (index, [view1, view2], label)
        def __len__(self):
            return 4

        def __getitem__(self, i):
            x = torch.rand(1, 8, 8)
            return i, [x, x], 0

    class Views(SoloStyle):
        def __getitem__(self, i):
            x = torch.rand(1, 8, 8)
            return [x, x], 0

    with pytest.raises(TypeError, match="solo-learn's training data set.*precompute_dataset"):
        pc.precompute_targets(prior, SoloStyle(), tmp_path / "a", progress=False)
    with pytest.raises(TypeError, match="a list of 2 images per item"):
        pc.precompute_targets(prior, Views(), tmp_path / "b", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

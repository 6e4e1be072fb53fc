import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate_ssl.data import DynamicSubsetSampler


def test_fresh_fixed_size_subset_each_epoch():
    s = DynamicSubsetSampler(1000, 0.1, seed=3)
    epochs = []
    for e in range(3):
        s.set_epoch(e)
        idx = list(s)
        assert len(idx) == len(s) == 100 and len(set(idx)) == 100
        epochs.append(set(idx))
    assert epochs[0] != epochs[1] != epochs[2]
    # depends only on (seed, epoch)
    t = DynamicSubsetSampler(1000, 0.1, seed=3)
    t.set_epoch(1)
    assert set(t) == epochs[1]


def test_auto_advance_without_set_epoch():
    s = DynamicSubsetSampler(100, 0.2)
    a, b = list(s), list(s)
    assert a != b and set(a) == set(s.subset(0).tolist()) and set(b) == set(s.subset(1).tolist())


def test_sharding_like_distributed_sampler():
    n, frac = 101, 0.5  # subset of 50 -> 25 per rank, no padding; 0.3 -> 30 -> 10 each with 3
    for replicas, fraction in ((2, frac), (3, 0.31)):
        shards = [DynamicSubsetSampler(n, fraction, seed=1, num_replicas=replicas, rank=r) for r in range(replicas)]
        for s in shards:
            s.set_epoch(4)
        parts = [list(s) for s in shards]
        full = shards[0].subset().tolist()
        assert all(len(p) == len(shards[0]) for p in parts)
        merged = [parts[i % replicas][i // replicas] for i in range(sum(map(len, parts)))]
        assert merged[: len(full)] == full  # interleaved shards rebuild the common subset
        assert set(merged) == set(full)  # padding repeats subset members only


def test_with_persistent_workers_and_state():
    ds = TensorDataset(torch.arange(40))
    s = DynamicSubsetSampler(ds, 0.25, seed=0)
    dl = DataLoader(ds, batch_size=5, sampler=s, num_workers=2, persistent_workers=True)
    seen = []
    for e in range(3):
        s.set_epoch(e)
        seen.append(torch.cat([b[0] for b in dl]).tolist())
        assert sorted(seen[-1]) == sorted(s.subset(e).tolist())
    assert seen[0] != seen[1]
    t = DynamicSubsetSampler(ds, 0.25)
    t.load_state_dict(s.state_dict())
    s.set_epoch(7), t.set_epoch(7)
    assert list(s) == list(t)

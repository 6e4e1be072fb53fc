"""Index tracking: the tracked indices are exactly those the yielded batch was built from."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from accelerate_ssl.data import track_indices


class IndexEncoding(Dataset):
    """Item i is (a tensor holding i, a dict also holding i): the batch tells which samples it has."""

    def __init__(self, n=53):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((2,), float(i)), {"i": i}


def _check_epochs(loader, tracker, epochs=3, break_at=(1, 2)):
    yielded = 0
    for epoch in range(epochs):
        if isinstance(getattr(loader, "sampler", None), DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for b, (x, meta) in enumerate(loader):
            yielded += 1
            assert torch.equal(tracker.current, x[:, 0].long())
            assert torch.equal(tracker.current, meta["i"])
            if (epoch, b) == break_at:  # early break, then a new epoch
                break
    assert tracker.batches == yielded


@pytest.mark.parametrize("persistent", [False, True])
def test_shuffled_workers_drop_last_early_break(persistent):
    loader = DataLoader(
        IndexEncoding(), batch_size=4, shuffle=True, num_workers=2, drop_last=True,
        persistent_workers=persistent, prefetch_factor=4,
    )
    tracker = track_indices(loader)
    _check_epochs(loader, tracker)


def test_single_process_and_batch_sampler_unchanged_output():
    ds = IndexEncoding(20)
    plain = DataLoader(ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(1))
    tracked = DataLoader(ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(1))
    tracker = track_indices(tracked)
    for (xa, ma), (xb, mb) in zip(plain, tracked):
        assert torch.equal(xa, xb) and torch.equal(ma["i"], mb["i"])  # the loader yields what it yielded
        assert torch.equal(tracker.current, xb[:, 0].long())
    assert track_indices(tracked) is tracker  # tracking twice is harmless


@pytest.mark.parametrize("rank", [0, 1])
def test_distributed_sampler(rank):
    ds = IndexEncoding(37)
    sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=5)
    loader = DataLoader(ds, batch_size=5, sampler=sampler, num_workers=2)
    tracker = track_indices(loader)
    _check_epochs(loader, tracker)
    sampler.set_epoch(9)
    seen = torch.cat([tracker.current for _ in loader])
    assert seen.tolist() == list(sampler)


def test_unsupported_loaders_have_clear_errors():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError, match="index="):
        track_indices(DataLoader(Stream()))
    with pytest.raises(ValueError, match="in_order=True"):
        track_indices(DataLoader(IndexEncoding(), num_workers=2, in_order=False))
    with pytest.raises(TypeError, match="DataLoader"):
        track_indices([1, 2, 3])


def test_dataloader_subclass_overriding_iter_is_refused_unless_named_one_to_one():
    from accelerate_ssl.data.indexing import track_loader

    class Skipping(DataLoader):  # yields every other batch: tracking its iterator in place would misalign
        def __iter__(self):
            for i, b in enumerate(super().__iter__()):
                if i % 2 == 0:
                    yield b

    with pytest.raises(TypeError, match="overrides DataLoader.__iter__"):
        track_indices(Skipping(IndexEncoding(), batch_size=4))

    class Prefetching(DataLoader):  # one batch ahead, one-to-one and in order: the user says so with inner=
        def __iter__(self):
            it = super().__iter__()
            nxt = next(it)
            for b in it:
                cur, nxt = nxt, b
                yield cur
            yield nxt

    dl = Prefetching(IndexEncoding(), batch_size=4, shuffle=True)
    wrapped, tracker = track_loader(dl, inner=dl)
    for x, d in wrapped:
        assert torch.equal(tracker.current, d["i"])
    assert tracker.batches == len(dl)

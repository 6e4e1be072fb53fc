"""ReLA's witness (accelerate_ssl/rela/witness.py): the prior that made the targets re-embeds a few training inputs and
stops training when their rows are not theirs, whatever path the rows took and whatever the head learnt; it confirms
aligned rows, says when it cannot judge, checks the prior's weights, and survives a checkpoint."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from accelerate_ssl import ReLA, create_prior, precompute_targets
from accelerate_ssl.rela import MisalignmentError, MisalignmentWarning, Witness, WitnessWarning
from accelerate_ssl.priors import Prior, Preprocess

PRIOR = "shipped:fashion-mnist-byol"
N = 1024


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory, fashion_mnist_available):
    from accelerate_ssl.data import FashionMNIST

    train = FashionMNIST("train", limit=N)
    store = precompute_targets(create_prior(PRIOR), train, tmp_path_factory.mktemp("witness") / "store", progress=False)
    return train, store


def _run(train, targets, steps, *, views="two-view", seed=0, **rela_kwargs):
    """The demo's recipe at toy size: BYOL + ReLA (lambda 1/2 with two views, 1 with one), batches of 32."""
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.demo import _uint8_tensor
    from accelerate_ssl.recipes import BYOL, images_to_tensor, loader_batches, train_ssl

    torch.manual_seed(seed)
    train.transform = _uint8_tensor
    backbone = ConvNet(widths=(8, 16, 32))
    model = BYOL(backbone, backbone.feature_dim, hidden_dim=64, out_dim=32)
    loader = DataLoader(train, batch_size=32, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed))
    rela = ReLA(targets, backbone, dataloader=loader, feature_dim=backbone.feature_dim, n_components=16,
                schedule="constant:0.5" if views == "two-view" else "constant:1", **rela_kwargs)
    opt = torch.optim.AdamW([*model.parameters(), *rela.parameters()], lr=1e-3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            train_ssl(model, loader_batches(loader, lambda im: images_to_tensor(im.squeeze(1))), steps, optimizer=opt,
                      view_generator=torch.Generator().manual_seed(seed + 1), rela=rela, rela_views="byol",
                      rela_step=views)
        finally:
            train.transform = None
    return rela, seen


def _rows(store) -> torch.Tensor:
    return torch.as_tensor(np.array(store.array))


def _witness(**kwargs) -> Witness:
    """For in-memory rows (they record no prior): the prior named explicitly."""
    return Witness(prior=create_prior(PRIOR), **kwargs)


def test_stops_training_on_a_shuffled_store_within_the_first_steps(fmnist):
    train, store = fmnist
    shuffled = _rows(store)[torch.randperm(N, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(MisalignmentError, match=r"their own rows ranked 0\.[3-6]\d .*chance.* another view of the same "
                                                r"image ranks 0\.[01]\d.*tracked loader.*witness=False") as err:
        _run(train, shuffled, 6, witness=_witness())
    assert "accelerate-ssl store verify" in str(err.value)


def test_confirms_an_aligned_store_and_never_stops_it(fmnist):
    train, store = fmnist
    rela, seen = _run(train, store, 12, witness=Witness(every=4))  # the store's own prior, rebuilt from its metadata
    assert rela.witness.status == "aligned" and rela.witness.alarm is None
    assert rela.witness.last["rows_rank"] < 0.1 and rela.witness.last["view_rank"] < 0.2
    assert rela.witness.last["rows_witnessed"] == 96  # the 6 most recent witnessed steps, 16 views each
    assert not [w for w in seen if issubclass(w.category, (WitnessWarning, MisalignmentWarning))]


def _class_shifted(train, store) -> torch.Tensor:
    """Rows of class c given to the samples of class c + 1 (each a random row of that class): a wrong pairing the
    head can learn, since it maps class to class."""
    labels = torch.as_tensor(train.targets)[:N]
    g = torch.Generator().manual_seed(0)
    rows = _rows(store)
    wrong = torch.empty_like(rows)
    for c in range(10):
        mine = (labels == c).nonzero().flatten()
        theirs = (labels == (c + 1) % 10).nonzero().flatten()
        wrong[mine] = rows[theirs[torch.randint(len(theirs), (len(mine),), generator=g)]]
    return wrong


def test_a_learnt_wrong_pairing_is_seen_in_the_first_steps(fmnist):
    """A class-to-class wrong pairing is learnt by the head (its own-vs-neighbour gap turns positive); the prior learns
    nothing, and sees it in its burst."""
    train, store = fmnist
    wrong = _class_shifted(train, store)
    rela, seen = _run(train, wrong, 6, witness=_witness(on_misalignment="warn"))
    assert rela.witness.alarm is not None and rela.witness.alarm["step"] <= 3
    witnessed = [w for w in seen if issubclass(w.category, MisalignmentWarning) and "witness" in str(w.message)]
    assert len(witnessed) == 1 and "rows are not these samples' own" in str(witnessed[0].message)
    with pytest.raises(MisalignmentError):  # by default it stops training
        _run(train, wrong, 6, witness=_witness())


def test_one_view_per_step_confirms_but_never_stops_and_says_so(fmnist):
    train, store = fmnist
    shuffled = _rows(store)[torch.randperm(N, generator=torch.Generator().manual_seed(1))]
    rela, seen = _run(train, shuffled, 8, views="one-view", witness=_witness(every=1))
    assert rela.witness.alarm is None and rela.witness.status == "one view"
    said = [w for w in seen if issubclass(w.category, WitnessWarning)]
    assert len(said) == 1 and "confirm the rows but not refute them" in str(said[0].message)
    rela, seen = _run(train, store, 8, views="one-view", witness=Witness(every=1))
    assert rela.witness.status == "aligned"  # aligned rows are still confirmed


def test_the_recorded_prior_is_rebuilt_and_other_weights_are_refused(fmnist):
    _, store = fmnist
    rela = ReLA(store, nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten()), feature_dim=4, schedule="constant:1")
    assert rela.witness.status == "waiting" and rela.witness.prior.describe()["spec"] == PRIOR
    with pytest.warns(WitnessWarning, match=r"witness is off: the prior given to Witness \('shipped:digits-byol'\) has "
                                            r"other weights than the targets were made with"):
        other = ReLA(store, nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten()), feature_dim=4, schedule="constant:1",
                     witness=Witness(prior=create_prior("shipped:digits-byol")))
    assert other.witness.status.startswith("off:")
    with pytest.warns(WitnessWarning, match=r"witness is off: capture='input' hooks a module that sees features.*"
                                            r"Witness\(input=model\)"):
        hooked = ReLA(store, nn.Linear(4, 4), capture="input", feature_dim=4, schedule="constant:1")
    assert "Witness(input=" in hooked.witness.status  # a classifier's input is features, not images
    off = ReLA(store, nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten()), feature_dim=4, witness=False)
    assert off.witness is None


class _Flat(nn.Module):
    def forward(self, x):
        return x.flatten(1)


def _flat_prior(dim: int) -> Prior:
    info = {"family": "test", "arch": "flat", "output_dim": dim, "weights": None, "weights_sha256": None}
    return Prior(_Flat(), "test:flat", Preprocess(channels=1, mean=[0.5], std=[0.5]), info)


def test_ranks_are_the_own_rows_place_among_the_batch(monkeypatch):
    """Values by hand: a prior that returns its input, rows that are (a permutation of) the prior's embeddings."""
    from accelerate_ssl.rela.witness import Witness as W

    w = W(prior=_flat_prior(4), burst=1, samples=4)
    w._on, w.status = True, "waiting"
    monkeypatch.setattr(w, "_to_unit_range", lambda x: x)  # the images are already the prior's input
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 1, 2, 2, generator=g)
    e = w.prior(w.prior.preprocess.batch(x))  # what the witness computes
    identity = lambda rows: rows  # noqa: E731  (no PCA)
    w._inputs = [x]
    w.observe(e.clone(), 4, identity, "index=")
    (stats, _), = list(w._reads.ready())
    assert stats[:3] == [4.0, 0.0, 0.0]  # every own row first
    order = torch.tensor([1, 2, 3, 0])
    w._inputs = [x]
    w.observe(e[order].clone(), 4, identity, "index=")
    (stats, _), = list(w._reads.ready())
    sim = torch.nn.functional.normalize(e, dim=1) @ torch.nn.functional.normalize(e[order], dim=1).T
    expected = [(sim[i] > sim[i, i]).sum().item() / 3 for i in range(4)]
    assert stats[0] == 4.0 and stats[1] == pytest.approx(sum(expected)) and stats[2] == pytest.approx(
        sum(u * u for u in expected))
    assert stats[3] == 0.0  # one view: no calibration


def test_unit_range_gives_the_prior_its_own_statistics():
    w = Witness(prior=_flat_prior(4))
    x = torch.randn(6, 1, 5, 5) * 3.0 + 7.0  # any normalisation of the user's
    out = w._to_unit_range(x)
    assert 0.0 <= float(out.min()) and float(out.max()) <= 1.0
    inside = out[(out > 0) & (out < 1)]
    assert float(inside.mean()) == pytest.approx(0.5, abs=0.05)  # the prior's mean (0.5), its std 0.5 (then clamped)


def test_a_checkpoint_keeps_the_calibration_and_witnesses_again_after_a_resume(fmnist):
    train, store = fmnist
    rela, _ = _run(train, store, 12)
    state = rela.state_dict()["witness"]
    assert state["steps"] == 12 and state["views"][0] >= 32 and len(state["recent"]) == 4
    fresh = ReLA(store, nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten()), feature_dim=4, schedule="constant:0.5")
    fresh.witness.load_state_dict(state)
    assert fresh.witness.steps == 12 and fresh.witness._views == state["views"]
    assert fresh.witness.armed and fresh.witness._burst_left == fresh.witness.burst  # step 12 is not a multiple of 50


def test_rows_carried_by_the_batch_are_witnessed_too(tmp_path):
    """A WebDataset loop whose rows ride in the batch (sidecars joined by key and content): every bookkeeping check
    passes, then the loop's own code mixes the rows up within the batch; the witness, rebuilt from the sidecars'
    recorded prior, stops it and names the sidecar path."""
    import test_streams as ts
    from accelerate_ssl import ShardedTargets, decode_images, precompute_sidecars

    urls = ts.write_shards(tmp_path / "data", sizes=(40, 40))
    targets = precompute_sidecars(ts.create_prior("random:convnet", in_channels=1), f"wds:{tmp_path}/data/shard-{{000000..000001}}.tar",
                                  tmp_path / "sidecars", batch_size=16, progress=False)
    targets = ShardedTargets.open(tmp_path / "sidecars")

    def loop(mix_up: bool, steps: int = 6):
        data = (ts.wds.WebDataset(urls, shardshuffle=False, empty_check=False).compose(targets.join())
                .map(decode_images()).map_dict(png=ts.as_tensor).to_tuple("png", "target"))
        torch.manual_seed(0)
        backbone = nn.Sequential(nn.Flatten(), nn.Linear(ts.SIZE * ts.SIZE, 16))
        rela = ReLA(targets, backbone, feature_dim=16, schedule="constant:0.5", witness=Witness(samples=16))
        opt = torch.optim.SGD([*backbone.parameters(), *rela.parameters()], lr=0.1)
        for step, (x, t) in enumerate(torch.utils.data.DataLoader(data, batch_size=16)):
            if step == steps:
                break
            x = x.float() / 255
            loss = backbone(x).pow(2).mean() + backbone(x.flip(3)).pow(2).mean()  # two views of each sample
            if mix_up:
                t = t.roll(1, dims=0)  # the loop's own bug: every sample gets its neighbour's row
            loss = rela.wrap(loss, targets=t)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return rela

    rela = loop(mix_up=False)
    assert rela.witness.status == "aligned" and rela.witness.prior.describe()["spec"] == "random:convnet"
    with pytest.raises(MisalignmentError, match=r"rows ride in the batch from sidecars"):
        loop(mix_up=True)


def test_a_witness_that_cannot_embed_turns_itself_off_and_says_so(fmnist):
    """A prior whose embeddings do not fit the store (the wrong prior given by hand, no weights recorded to compare)
    cannot break training: the witness goes off, once, naming why."""
    train, store = fmnist
    rela, seen = _run(train, _rows(store), 2, witness=Witness(prior=_flat_prior(784)))
    said = [str(w.message) for w in seen if issubclass(w.category, WitnessWarning)]
    assert len(said) == 1 and re.search(r"witness is off: re-embedding the training inputs failed \(ValueError: .*have "
                                        r"dim 784 but the targets ReLA was opened on have dim 128", said[0])
    assert rela.witness.status.startswith("off:") and rela.steps == 2 and rela.witness._handle is None


def test_a_spatial_stores_rows_are_witnessed_as_the_mean_of_the_priors_map(fmnist, tmp_path):
    """A spatial store's rows are its maps' means: the witness re-embeds with the prior's map, not its forward (here a
    forward that differs from the map's mean, negated, would rank every own row last)."""
    train, _ = fmnist
    store = precompute_targets(create_prior(PRIOR), train, tmp_path / "spatial", spatial=16, progress=False)
    prior = create_prior(PRIOR)
    prior.forward = lambda x: -prior.feature_map(x).mean((2, 3))  # not what the store's rows are
    rela, seen = _run(train, store, 12, witness=Witness(prior=prior, every=4))
    assert rela.witness.status == "aligned" and rela.witness.alarm is None
    assert rela.witness.last["rows_rank"] < 0.1


@pytest.fixture(scope="module")
def fmnist_maps(fmnist, tmp_path_factory):
    train, _ = fmnist
    return precompute_targets(create_prior(PRIOR), train, tmp_path_factory.mktemp("maps") / "store", spatial=True,
                              progress=False)


def _per_view_run(train, store, steps, swap: bool, batch: int = 32, images=None, seed: int = 0, **witness_kwargs):
    """BYOL's two views per step with their boxes (wrap(geometry=)); ``swap``: the geometry's view blocks in the other
    order than the features (each view pulled toward the other view's box); ``images``: train on these instead of
    ``train``'s (another data set: no ``dataset=`` given, as a loop that never checks one)."""
    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.recipes import BYOL, BYOL_VIEWS, images_to_tensor, random_views

    torch.manual_seed(seed)
    other = images is not None
    images = images_to_tensor(train.data) if images is None else images
    backbone = ConvNet(widths=(8, 16, 32))
    model = BYOL(backbone, backbone.feature_dim, hidden_dim=64, out_dim=32)
    rela = ReLA(store, backbone, dataset=None if other else train, feature_dim=backbone.feature_dim, n_components=16,
                schedule="constant:0.5", witness=Witness(**witness_kwargs))
    opt = torch.optim.AdamW([*model.parameters(), *rela.parameters()], lr=1e-3)
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        index = torch.randperm(N, generator=g)[:batch]
        drawn = [random_views(images[index], BYOL_VIEWS, g, geometry=True) for _ in range(2)]
        views, boxes = [v for v, _ in drawn], [b for _, b in drawn]
        features = [backbone(v) for v in views]
        loss = rela.wrap(lambda: model.step_loss(features, views, None), index=index,
                         geometry=torch.cat(boxes[::-1] if swap else boxes))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return rela


def test_per_view_rows_swapped_between_the_views_stop_training(fmnist, fmnist_maps):
    """Before: the witness compared the first view's rows with both views' inputs and, the rows being the samples' own
    image, said "aligned" whatever boxes they were pooled over."""
    train, _ = fmnist
    rela = _per_view_run(train, fmnist_maps, 6, swap=False, every=1)
    assert rela.witness.status == "aligned" and rela.witness.last["own_box"] > 0.6
    with pytest.raises(MisalignmentError, match=r"each view's input was closer to the other view's box than to its own"
                                                 r".*geometry=torch\.cat\(\[g0, g1\]\)"):
        _per_view_run(train, fmnist_maps, 6, swap=True, every=1)


def test_a_one_view_loop_on_other_rows_says_so_within_the_burst(fmnist):
    """Before: with the default settings it stayed "waiting" without a word (only the head check warned, at batch
    12). Now it says, by the end of its first burst, that it cannot refute the rows and that they rank at chance."""
    train, store = fmnist
    shuffled = _rows(store)[torch.randperm(N, generator=torch.Generator().manual_seed(1))]
    rela, seen = _run(train, shuffled, 5, views="one-view", witness=_witness())
    said = [str(w.message) for w in seen if issubclass(w.category, WitnessWarning)]
    assert len(said) == 1 and rela.witness.status == "one view" and rela.witness.alarm is None
    assert re.search(r"cannot refute these rows: the backbone sees one view per sample per step.* rank 0\.[4-6]\d \+- "
                     r"0\.\d\d .*that is chance: most likely the rows are not these samples' own", said[0])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_per_view_rows_of_another_data_sets_maps_stop_within_the_first_steps_at_four_samples_a_step(fmnist,
                                                                                                   fmnist_maps, seed):
    """Before: at a few samples per step the first burst (4 steps) saw too few views to calibrate, the next witnessed
    step was step 50, and a loop on digits with Fashion-MNIST's maps (no dataset= given) trained on without a stop.
    Now the witness goes on witnessing every step until it has a verdict."""
    from accelerate_ssl.data.datasets import Digits
    from accelerate_ssl.recipes import images_to_tensor

    train, _ = fmnist
    digits = images_to_tensor(Digits().data[:N])  # another data set, indexed as if it were the store's
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # (and the "no data set was checked" warning: what this loop ignored)
        rela = _per_view_run(train, fmnist_maps, 40, swap=False, batch=4, images=digits, seed=seed,
                             on_misalignment="warn")
    said = [str(w.message) for w in seen if issubclass(w.category, MisalignmentWarning) and "witness" in str(w.message)]
    assert rela.witness.status == "misaligned" and rela.witness.alarm["step"] <= 20, rela.witness.last
    assert re.search(r"their own rows ranked 0\.[3-6]\d .*chance.*index=", said[0])


def test_aligned_per_view_rows_at_four_samples_a_step_are_confirmed_and_never_stopped(fmnist, fmnist_maps):
    train, _ = fmnist
    rela = _per_view_run(train, fmnist_maps, 40, swap=False, batch=4)
    assert rela.witness.status == "aligned" and rela.witness.alarm is None

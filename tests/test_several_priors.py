"""ReLA over several priors at once: each prior has its own head, its own standardisation and every identity check of
its own store (fingerprint, keys, sidecar tag, alignment check, witness), one schedule and one wrap; the checkpoint
holds each prior's head and store identity and refuses another set of stores; one pass precomputes several priors."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from accelerate_ssl import ReLA, create_prior, precompute_targets
from accelerate_ssl.rela import MisalignmentError, MisalignmentWarning, Witness
from accelerate_ssl.rela.term import combine_losses
from accelerate_ssl.schedules import Constant

N, D_IN, D_F, B = 1024, 16, 32, 16


def data():
    """Inputs and two priors' targets, each a fixed non-linear function of the input (row i = sample i's target):
    prior "b" of another width, a 100x larger scale and an offset."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D_IN, generator=g)
    a = torch.tanh(x @ torch.randn(D_IN, 12, generator=g)) @ torch.randn(12, 12, generator=g)
    b = 100 * torch.sin(x @ torch.randn(D_IN, 20, generator=g)) + 50
    return x, a, b


def student():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 64), nn.ReLU(), nn.Linear(64, D_F))


def batches(x, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randperm(N, generator=g)[:B]
        yield x[idx], idx


def train(targets, steps, seed=0, **rela_kwargs):
    """ReLA alone (lambda 1) for ``steps`` batches; returns ReLA, the per-step losses and the warnings."""
    x, *_ = data()
    net = student()
    kwargs = {"schedule": Constant(1.0), "feature_dim": D_F, **rela_kwargs}
    rela = ReLA(targets, net, **kwargs)
    opt = torch.optim.AdamW([*net.parameters(), *rela.parameters()], lr=3e-3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", MisalignmentWarning)
        losses = run_steps(net, rela, opt, batches(x, steps, seed))
    return rela, net, losses, [w for w in seen if issubclass(w.category, MisalignmentWarning)]


def run_steps(net, rela, opt, steps) -> list[float]:
    """One optimiser step per ``(x, index)`` of ``steps`` with a small user loss (what lambda hands over to); the
    per-step losses."""
    losses = []
    for xb, idx in steps:
        loss = rela.wrap(1e-3 * net(xb).pow(2).mean(), index=idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


# ---------------------------------------------------------------------------------------------- heads, standardisation
def test_each_prior_has_its_own_head_and_standardisation_and_equal_weights():
    x, a, b = data()
    rela, *_ = train({"a": a, "b": b}, 0)
    assert (rela.priors["a"].head.out_features, rela.priors["b"].head.out_features) == (12, 20)  # auto: each its dim
    assert rela.priors["a"].head is not rela.priors["b"].head
    assert len(list(rela.parameters())) == 4  # both heads' weight and bias
    # each prior is standardised on its own rows (Eq. 41): b's 100x scale and offset are gone from its reduced rows
    for name, rows in (("a", a), ("b", b)):
        reduced = rela.priors[name].targets(torch.arange(N), "cpu")
        assert torch.allclose(rela.priors[name].targets.pca.mean.float(), rows.mean(0), atol=1e-3)
        assert reduced.mean(0).abs().max() < 1e-3 and 0.5 < reduced.var(0).sum() / reduced.shape[1] < 2
    # one wrap: the mean of the priors' losses, each what that prior alone gives (same features, same fitted head)
    xb, idx = next(batches(x, 1))
    alone = {}
    for name, rows in (("a", a), ("b", b)):
        single, net, *_ = train(rows, 0)
        net(xb)
        alone[name] = float(single.wrap(torch.zeros(()), index=idx).detach())
    net = student()
    both = ReLA({"a": a, "b": b}, net, feature_dim=D_F, schedule=Constant(1.0), balance="equal")
    net(xb)
    loss = both.wrap(torch.zeros(()), index=idx)
    assert abs(float(loss.detach()) - (alone["a"] + alone["b"]) / 2) < 1e-6
    stats = both.stats["priors"]
    assert {n: round(s["loss_rela"], 5) for n, s in stats.items()} == {n: round(v, 5) for n, v in alone.items()}
    assert [s["weight"] for s in stats.values()] == [0.5, 0.5] and {s["lambda"] for s in stats.values()} == {1.0}


def test_a_list_names_priors_by_position_and_one_prior_is_unchanged():
    _, a, b = data()
    rela, *_ = train([a, b], 3)
    assert list(rela.priors) == ["0", "1"] and set(rela.stats["priors"]) == {"0", "1"}
    with pytest.raises(AttributeError, match=r"rela.priors\[name\].head"):
        rela.head  # noqa: B018 (one per prior: ambiguous)
    single, _, losses, _ = train(a, 3)
    listed, _, listed_losses, _ = train([a], 3)
    assert losses == listed_losses and "priors" not in single.stats and single.head is not None
    # a lone store's checkpoint keeps the single-store format, key for key
    assert set(single.state_dict()) == {"head", "dims", "own_optimizer", "head_mode", "head_needs_fit", "schedule",
                                        "steps", "n_components", "handover", "store_rows", "store", "alignment_check",
                                        "witness"}
    assert set(single.state_dict()) == set(listed.state_dict())


def test_teacher_dropping_keeps_each_samples_hardest_prior():
    g = torch.Generator().manual_seed(0)
    losses = torch.rand(3, 2 * 64, generator=g, requires_grad=True)  # 3 priors, 2 views of 64 samples
    equal, w = combine_losses(losses, 64, "equal")
    assert torch.allclose(equal, losses.mean()) and torch.equal(w, torch.full((3,), 1 / 3))
    total, w = combine_losses(losses, 64, "drop", drop=0.5, generator=g)
    assert abs(float(w.sum()) - 1) < 1e-6
    total.backward()
    grad = losses.grad.reshape(3, 2, 64)
    kept = grad[:, 0] > 0
    assert torch.equal(kept, grad[:, 1] > 0)  # both views of a sample share its coefficient
    hardest = losses.detach().reshape(3, 2, 64).mean(1).argmax(0)
    assert kept[hardest, torch.arange(64)].all()  # each sample's hardest prior is never dropped
    others = kept.sum() - 64
    assert 0.3 < float(others) / (2 * 64) < 0.7  # the other two are dropped about half the time
    assert torch.allclose(combine_losses(losses.detach(), 64, "drop", drop=0.0)[0], losses.detach().mean())


def test_drop_balance_trains_and_logs_weights_and_the_schedule_reads_the_mean():
    _, a, b = data()
    rela, _, losses, _ = train({"a": a, "b": b}, 5, balance="drop", schedule="decay", total_steps=100)
    w = [rela.stats["priors"][n]["weight"] for n in "ab"]
    assert abs(sum(w) - 1) < 1e-6 and w != [0.5, 0.5]
    per_prior = [rela.stats["priors"][n]["loss_rela"] for n in "ab"]
    assert rela.schedule.steps == 5 and all(np.isfinite(losses))
    with pytest.raises(ValueError, match="balance must be one of"):
        ReLA({"a": a, "b": b}, student(), balance="max")
    assert per_prior[0] != per_prior[1]


# ---------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_resumes_every_prior_and_refuses_another_set_of_stores():
    x, a, b = data()
    first, net, _, _ = train({"a": a, "b": b}, 5, balance="drop")
    state, weights = first.state_dict(), {k: v.clone() for k, v in net.state_dict().items()}
    assert set(state["priors"]) == {"a", "b"} and set(state["priors"]["a"]) >= {"head", "store", "witness"}
    net = student()
    net.load_state_dict(weights)
    resumed = ReLA({"a": a, "b": b}, net, feature_dim=D_F, schedule=Constant(1.0), balance="drop")
    resumed.load_state_dict(state)
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), first.parameters()))
    assert resumed.state_dict()["balance"]["generator"].equal(state["balance"]["generator"])
    with pytest.raises(ValueError, match=r"held the priors \['a', 'b'\], this one holds \['a', 'c'\]"):
        ReLA({"a": a, "c": b}, student(), feature_dim=D_F, schedule=Constant(1.0)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"trained for prior 'b' on another target store"):
        ReLA({"a": a, "b": a + 1}, student(), feature_dim=D_F, schedule=Constant(1.0)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"trained for prior 'a' on another target store"):
        ReLA({"a": a + 1, "b": b}, student(), feature_dim=D_F, schedule=Constant(1.0)).load_state_dict(state)
    with pytest.raises(ValueError, match=r"a ReLA over 2 priors \(\['a', 'b'\]\), but this ReLA holds one target store"):
        ReLA(a, student(), feature_dim=D_F, schedule=Constant(1.0)).load_state_dict(state)
    single, *_ = train(a, 2)
    with pytest.raises(ValueError, match=r"checkpoint is of a ReLA over one target store, but this ReLA holds 2 priors"):
        ReLA({"a": a, "b": b}, student(), feature_dim=D_F, schedule=Constant(1.0)).load_state_dict(single.state_dict())


def test_a_resumed_run_continues_exactly():
    x, a, b = data()
    steps = list(batches(x, 8))

    net = student()
    rela = ReLA({"a": a, "b": b}, net, feature_dim=D_F, schedule="decay", total_steps=8, balance="drop")
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)  # the heads: ReLA's own optimisers
    whole = run_steps(net, rela, opt, steps)
    net = student()
    rela = ReLA({"a": a, "b": b}, net, feature_dim=D_F, schedule="decay", total_steps=8, balance="drop")
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    head = run_steps(net, rela, opt, steps[:5])
    saved = (rela.state_dict(), net.state_dict(), opt.state_dict())
    net = student()
    net.load_state_dict(saved[1])
    rela = ReLA({"a": a, "b": b}, net, feature_dim=D_F, schedule="decay", total_steps=8, balance="drop")
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    opt.load_state_dict(saved[2])
    rela.load_state_dict(saved[0])
    assert head + run_steps(net, rela, opt, steps[5:]) == whole  # resumed past the hand-over (step 4 of 8)
    assert rela.head_mode == "own" and rela.stats["lambda"] == 0.0


# ---------------------------------------------------------------------------------------------- checks per prior
def test_the_alignment_check_watches_each_prior_and_names_it():
    _, a, b = data()
    shuffled = b[torch.randperm(N, generator=torch.Generator().manual_seed(0))]
    rela, _, _, warned = train({"a": a, "b": shuffled}, 31)
    assert len(warned) == 1 and "alignment check of prior 'b'" in str(warned[0].message)
    assert rela.priors["b"].guard.alarm is not None and rela.priors["a"].guard.alarm is None
    rela, _, _, warned = train({"a": shuffled, "b": a}, 31)
    assert len(warned) == 1 and "of prior 'a'" in str(warned[0].message)


def test_rows_carried_by_the_batch_are_each_priors_own():
    _, a, b = data()
    net = student()
    rela = ReLA({"a": a, "b": b}, net, feature_dim=D_F, schedule=Constant(1.0))
    idx = torch.arange(B)
    for bad, message in [(a[idx], r"got one tensor but ReLA holds 2 priors \(\['a', 'b'\]\): pass targets=\{name"),
                         ({"a": a[idx]}, r"got rows for \['a'\] but ReLA holds the priors \['a', 'b'\]"),
                         ({"a": a[idx], "b": a[idx]}, r"rows have dim 12 but the targets ReLA was opened on have dim 20")]:
        net(torch.randn(B, D_IN))
        with pytest.raises(ValueError, match=message):
            rela.wrap(torch.zeros(()), targets=bad)
    net(torch.randn(B, D_IN))
    loss = rela.wrap(torch.zeros(()), targets={"a": a[idx], "b": b[idx]})
    assert torch.isfinite(loss)


def test_carried_rows_go_to_the_prior_of_their_name_whatever_the_order():
    """Values, not shapes: two priors of one width given their rows in the other order than ReLA holds them; each
    prior's loss is the loss a ReLA of that prior alone computes on its own rows (a mix-up of names would train each
    head toward the other prior's rows without any width to refuse it)."""
    x, a, _ = data()
    c = torch.cos(x @ torch.randn(D_IN, 12, generator=torch.Generator().manual_seed(5))) * 3
    idx = torch.arange(B) * 7
    rela = ReLA({"a": a, "c": c}, student(), feature_dim=D_F, schedule=Constant(1.0), balance="equal")
    rela.backbone(x[idx])
    rela.wrap(torch.zeros(()), targets={"c": c[idx], "a": a[idx]})
    per = rela.stats["priors"]
    for name, rows in (("a", a), ("c", c)):
        alone = ReLA(rows, student(), feature_dim=D_F, schedule=Constant(1.0))
        alone.backbone(x[idx])
        own = alone.wrap(torch.zeros(()), targets=rows[idx])
        assert per[name]["loss_rela"] == pytest.approx(float(own), rel=1e-5)
    assert per["a"]["loss_rela"] != pytest.approx(per["c"]["loss_rela"], rel=1e-3)


# ---------------------------------------------------------------------------------------------- real stores
@pytest.fixture(scope="module")
def stores(tmp_path_factory, fashion_mnist_available):
    """Two shipped priors precomputed in one pass over 512 Fashion-MNIST images, and the same data set."""
    from accelerate_ssl.data import FashionMNIST

    train = FashionMNIST("train", limit=512)
    root = tmp_path_factory.mktemp("several")
    priors = {"digits": create_prior("shipped:digits-byol"), "fmnist": create_prior("shipped:fashion-mnist-byol")}
    keys = [f"img{i:04d}" for i in range(512)]
    out = precompute_targets(priors, train, {n: root / n for n in priors}, keys=keys, progress=False)
    return train, out, root, priors


def test_one_pass_writes_each_store_as_a_run_of_that_prior_alone(stores, tmp_path):
    train, out, root, priors = stores
    assert list(out) == ["digits", "fmnist"]
    alone = precompute_targets(priors["fmnist"], train, tmp_path / "alone", keys=[f"img{i:04d}" for i in range(512)],
                               progress=False)
    assert alone.metadata["file_sha256"] == out["fmnist"].metadata["file_sha256"]
    assert np.array_equal(np.load(alone.path / "identity.npy"), np.load(out["fmnist"].path / "identity.npy"))
    # a list of priors with a list of folders; a finished store is returned as it is, the missing one computed
    listed = precompute_targets([priors["digits"], priors["fmnist"]], train, [root / "digits", tmp_path / "second"],
                                keys=[f"img{i:04d}" for i in range(512)], progress=False)
    assert listed[0].path == out["digits"].path and listed[1].metadata["file_sha256"] == alone.metadata["file_sha256"]
    with pytest.raises(TypeError, match="one folder per prior"):
        precompute_targets(priors, train, tmp_path / "one")
    with pytest.raises(ValueError, match="distinct folders"):
        precompute_targets([priors["digits"], priors["fmnist"]], train, [tmp_path / "x", tmp_path / "x"])


def test_each_store_is_checked_against_the_data_set(stores, tmp_path):
    from accelerate_ssl.data import FashionMNIST
    from accelerate_ssl.targets.store import TargetStoreMismatchError

    train, out, _, priors = stores
    other = precompute_targets(priors["fmnist"], FashionMNIST("test", limit=512), tmp_path / "test", progress=False)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 16))
    ReLA(out, backbone, dataset=train, feature_dim=16)  # both computed on it
    with pytest.raises(TargetStoreMismatchError, match=r"Prior 'fmnist' of this ReLA: Target store .*test"):
        ReLA({"digits": out["digits"], "fmnist": other}, backbone, dataset=train, feature_dim=16)
    with pytest.raises(TargetStoreMismatchError, match=r"Prior 'digits' of this ReLA"):
        ReLA({"digits": other, "fmnist": out["fmnist"]}, backbone, dataset=train, feature_dim=16)


def test_keys_are_mapped_by_each_stores_own_key_list(stores, tmp_path):
    from accelerate_ssl.targets.keys import TargetKeyError

    train, out, _, priors = stores
    renamed = precompute_targets(priors["fmnist"], train, tmp_path / "renamed",
                                 keys=[f"other{i:04d}" for i in range(512)], progress=False)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 16))
    x = torch.rand(4, 1, 28, 28)
    rela = ReLA(out, backbone, feature_dim=16, schedule=Constant(1.0), witness=False)
    backbone(x)
    assert torch.isfinite(rela.wrap(torch.zeros(()), keys=["img0003", "img0100", "img0007", "img0511"]))
    rela = ReLA({"digits": out["digits"], "fmnist": renamed}, backbone, feature_dim=16, schedule=Constant(1.0),
                witness=False)
    backbone(x)
    with pytest.raises(TargetKeyError, match=r"Prior 'fmnist' of this ReLA: .*img0003"):
        rela.wrap(torch.zeros(()), keys=["img0003", "img0100", "img0007", "img0511"])


def _run_two(train, targets, steps, **rela_kwargs):
    """The demo's recipe at toy size with two views per step (the witness judges): BYOL + ReLA, lambda 1/2."""
    from torch.utils.data import DataLoader

    from accelerate_ssl.backbones import ConvNet
    from accelerate_ssl.demo import _uint8_tensor
    from accelerate_ssl.recipes import BYOL, images_to_tensor, loader_batches, train_ssl

    torch.manual_seed(0)
    train.transform = _uint8_tensor
    backbone = ConvNet(widths=(8, 16, 32))
    model = BYOL(backbone, backbone.feature_dim, hidden_dim=64, out_dim=32)
    loader = DataLoader(train, batch_size=32, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0))
    rela = ReLA(targets, backbone, dataloader=loader, feature_dim=backbone.feature_dim, n_components=16,
                schedule="constant:0.5", **rela_kwargs)
    opt = torch.optim.AdamW([*model.parameters(), *rela.parameters()], lr=1e-3)
    try:
        train_ssl(model, loader_batches(loader, lambda im: images_to_tensor(im.squeeze(1))), steps, optimizer=opt,
                  view_generator=torch.Generator().manual_seed(1), rela=rela, rela_views="byol", rela_step="two-view")
    finally:
        train.transform = None
    return rela


def test_each_prior_has_its_own_witness(stores):
    train, out, _, priors = stores
    rela = _run_two(train, out, 8, witness=Witness(every=2))
    assert {n: t.witness.status for n, t in rela.priors.items()} == {"digits": "aligned", "fmnist": "aligned"}
    assert rela.priors["digits"].witness.prior.spec == "shipped:digits-byol"  # each prior's own, rebuilt from its store
    assert rela.priors["fmnist"].witness.prior.spec == "shipped:fashion-mnist-byol"
    rows = torch.as_tensor(np.array(out["fmnist"].array))
    shuffled = rows[torch.randperm(512, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(MisalignmentError, match=r"witness of prior 'fmnist'.*fashion-mnist-byol"):
        _run_two(train, {"digits": out["digits"], "fmnist": shuffled}, 6,
                 witness={"digits": True, "fmnist": Witness(prior=create_prior("shipped:fashion-mnist-byol"))})
    with pytest.raises(ValueError, match=r"each prior's witness needs its own prior"):
        ReLA(out, nn.Linear(4, 4), witness=Witness(prior=priors["digits"]))


def test_sidecar_rows_are_checked_against_each_priors_folder(tmp_path):
    pytest.importorskip("webdataset")
    from test_streams import SIZE, as_tensor, write_shards

    import webdataset as wds

    from accelerate_ssl import decode_images, precompute_sidecars
    from accelerate_ssl.targets.sidecar import SidecarError

    urls = write_shards(tmp_path / "data", sizes=(6, 5))
    spec = f"wds:{tmp_path}/data/shard-{{000000..000001}}.tar"
    folders = {name: precompute_sidecars(create_prior("random:convnet", in_channels=1, seed=seed).eval(), spec,
                                         tmp_path / name, batch_size=4, progress=False)
               for name, seed in (("a", 0), ("b", 7))}
    data = (wds.WebDataset(urls, shardshuffle=False, empty_check=False).compose(folders["a"].join(field="a"))
            .compose(folders["b"].join(field="b")).map(decode_images()).map_dict(png=as_tensor)
            .to_tuple("png", "a", "b"))
    x, t_a, t_b = next(iter(torch.utils.data.DataLoader(data, batch_size=5)))
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, 16))
    rela = ReLA(folders, backbone, feature_dim=16, n_components=4, total_steps=10, witness=False)
    backbone(x.float() / 255)
    assert torch.isfinite(rela.wrap(torch.zeros(()), targets={"a": t_a, "b": t_b}))
    backbone(x.float() / 255)
    with pytest.raises(SidecarError, match=rf"come from the sidecar targets '{re.escape(str(tmp_path / 'a'))}'.*but "
                                           rf"ReLA was opened on '{re.escape(str(tmp_path / 'b'))}'"):
        rela.wrap(torch.zeros(()), targets={"a": t_a, "b": t_a})  # prior a's rows handed to prior b

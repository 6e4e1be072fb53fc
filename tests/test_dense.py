"""ReLA's dense term: the student's map pulled toward the prior's stored map through a 1x1 head, location by location,
with the views' boxes pooled when wrap gets their geometry; its checkpoint, refusals and training."""

import pytest
import torch
import torch.nn.functional as F

from _precompute_worker import tiny_dataset
from accelerate_ssl import ReLA
from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.rela.dense import dense_target_maps
from accelerate_ssl.targets.views import whole_image

N = 24
pytestmark = pytest.mark.usefixtures("cpu_one_thread")


@pytest.fixture(scope="module")
def store(tiny_spatial_store):
    return tiny_spatial_store


def images(idx):
    return torch.as_tensor(tiny_dataset(N).data[idx.numpy()], dtype=torch.float32).unsqueeze(1) / 255


def student_and_rela(store, dense=True, seed=0, **kw):
    torch.manual_seed(seed)
    student = ConvNet(widths=(8, 16))  # its .features: a [B, 16, 4, 4] map of a 16 px image
    kw = {"dataset": tiny_dataset(N), "feature_dim": 16, "n_components": 4, "total_steps": 50, "witness": False, **kw}
    return student, ReLA(store, student, dense=student.features if dense else None, **kw)


def test_the_loss_is_the_mean_of_the_global_and_the_dense_term(store):
    """One wrap: the global term as without dense=, and the dense term recomputed by hand from the captured map (pooled
    to the stored 2x2 grid), the stored maps (standardised as the rows are) and the fitted 1x1 head."""
    idx = torch.tensor([1, 4, 9, 13, 20, 22])
    x = images(idx)
    student, plain = student_and_rela(store, dense=False, schedule="constant:1")  # lambda = 1: the loss is ReLA's
    global_loss = plain.wrap(torch.tensor(0.0), index=idx, features=student(x))
    student, rela = student_and_rela(store, schedule="constant:1")
    captured = []
    student.features.register_forward_hook(lambda m, a, out: captured.append(out))
    feats = student(x)
    loss = rela.wrap(torch.tensor(0.0), index=idx, features=feats)
    term = rela.priors["0"]
    assert term.dense.linear is not None and term.dense.linear.weight.shape == (4, 16)  # 16 map channels -> 4 comps
    pooled = F.adaptive_avg_pool2d(captured[0], (2, 2)).permute(0, 2, 3, 1).reshape(-1, 16)
    target = term.targets.reduce_raw(store.maps(idx).permute(0, 2, 3, 1).reshape(-1, 5), torch.device("cpu"))
    dense = (1 - F.cosine_similarity(term.dense.linear(pooled), target, dim=1)).mean()
    torch.testing.assert_close(loss, 0.5 * (global_loss + dense), rtol=1e-5, atol=1e-6)
    assert {id(p) for p in rela.parameters()} >= {id(p) for p in term.dense.linear.parameters()}


def test_a_views_target_map_is_its_box_pooled_onto_the_grid(store):
    idx = torch.tensor([0, 5, 7])
    whole = torch.stack([whole_image(16, 16) for _ in idx])
    torch.testing.assert_close(dense_target_maps(store, idx, 1, whole), store.maps(idx), rtol=0, atol=1e-5)
    left = torch.tensor([[0.0, 0.0, 8.0, 16.0, 0.0, 16.0, 16.0]] * 3)  # the left half of the image: the left cells
    maps, stored = dense_target_maps(store, idx, 1, left), store.maps(idx)
    # its two bins sample the left cells' row centres at x = -1/4 (clamped: the left cell) and x = 1/4 (RoIAlign, aligned)
    torch.testing.assert_close(maps[..., 0], stored[..., 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(maps[..., 1], 0.75 * stored[..., 0] + 0.25 * stored[..., 1], rtol=0, atol=1e-5)
    mirrored = dense_target_maps(store, idx, 1, torch.cat([left[:, :4], torch.ones(3, 1), left[:, 5:]], 1))
    torch.testing.assert_close(mirrored, maps.flip(-1))  # a flipped view sees its box mirrored
    # no geometry: every view of a sample gets that sample's stored map (views stacked as blocks of the samples)
    torch.testing.assert_close(dense_target_maps(store, idx, 2, None), torch.cat([store.maps(idx)] * 2), rtol=0, atol=0)
    torch.testing.assert_close(dense_target_maps(store, idx, 3, None, grid=(1, 2)),  # a coarser student: rows averaged
                               torch.cat([store.maps(idx).mean(2, keepdim=True)] * 3), rtol=0, atol=1e-6)


def test_geometry_pools_both_terms_and_two_views_train(store):
    """Two views per sample with their geometry: global rows and target maps are pooled per view, and training on
    them fits them: the loss of two batches of two views falls as a user's loop trains on them (lambda 1)."""
    student, rela = student_and_rela(store, alignment_check=False, schedule="constant:1")  # random prior and images:
    # nothing to align; lambda 1 throughout (the user's loss here is a constant)
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3)
    boxes = [torch.tensor([[x, y, x + 10, y + 10, flip, 16, 16]], dtype=torch.float32).repeat(8, 1)
             for x, y, flip in ((1, 2, 0), (4, 3, 1))]  # two views, never the same box, the second one flipped
    batches = []
    for idx in (torch.arange(8), torch.arange(8, 16)):  # two batches, in turn
        x = images(idx)
        batches.append((idx, torch.cat([F.interpolate(x[:, :, int(b[0, 1]):int(b[0, 3]), int(b[0, 0]):int(b[0, 2])],
                                                      size=16, mode="bilinear") for b in boxes])))
    losses = []
    for step in range(40):
        idx, views = batches[step % 2]
        loss = rela.wrap(torch.tensor(0.0), index=idx, geometry=torch.cat(boxes), features=student(views))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert rela.priors["0"].dense.mode == "own"  # built at the first wrap, after the optimiser: ReLA's AdamW trains it


def test_dense_checkpoints_round_trip_and_refusals_name_the_fix(store, tmp_path):
    idx = torch.tensor([2, 3, 5, 8])
    student, rela = student_and_rela(store)
    rela.wrap(torch.tensor(0.0), index=idx, features=student(images(idx)))
    state = rela.state_dict()
    torch.save(state, tmp_path / "rela.pt")
    _, fresh = student_and_rela(store, seed=1)
    fresh.load_state_dict(torch.load(tmp_path / "rela.pt", weights_only=False))
    torch.testing.assert_close(fresh.priors["0"].dense.linear.weight, rela.priors["0"].dense.linear.weight)
    _, flat = student_and_rela(store, dense=False)
    with pytest.raises(ValueError, match="with a dense term"):
        flat.load_state_dict(state)
    with pytest.raises(ValueError, match="spatial=k"):
        ReLA(torch.randn(N, 6), student, dense=student.features, feature_dim=16, witness=False)
    student, rela = student_and_rela(store, dense=True)
    rela_pooled = ReLA(store, student, dense=student, dataset=tiny_dataset(N), feature_dim=16, witness=False,
                       total_steps=10)  # the student's output is its pooled [B, 16] features
    feats = student(images(idx))
    with pytest.raises(ValueError, match=r"not a feature map \[B, C, h, w\]"):
        rela_pooled.wrap(torch.tensor(0.0), index=idx, features=feats)
    student, rela = student_and_rela(store)
    with pytest.raises(ValueError, match="carries rows of 5 values, not each sample's 2x2 map"):
        rela.wrap(torch.tensor(0.0), targets=store[idx], features=student(images(idx)))


def test_geometry_with_one_backbone_call_per_view_and_several_priors_is_the_index_path_for_whole_views(store, tmp_path):
    """Views forwarded one call each (the usual loop) with whole-image geometry train exactly as index= does: the
    per-view rows keep the batch's sample count (for the priors' balance and the checks)."""
    import accelerate_ssl.targets.precompute as pc
    from accelerate_ssl.priors import create_prior

    other = pc.precompute_targets(create_prior("random:convnet"), tiny_dataset(N), tmp_path / "k4", batch_size=8,
                                  progress=False, spatial=4)  # a second prior's store (the same store twice is refused)
    idx = torch.tensor([3, 6, 10, 15])
    x = images(idx)
    whole = torch.stack([whole_image(16, 16) for _ in range(8)])
    losses = []
    for geometry in (whole, None):
        torch.manual_seed(0)
        student = ConvNet(widths=(8, 16))
        rela = ReLA({"a": store, "b": other}, student, dataset=tiny_dataset(N), feature_dim=16, n_components=4,
                    schedule="constant:1", witness=False, seed=3)
        student(x), student(x.flip(-1))  # two views, one call each
        losses.append(rela.wrap(torch.tensor(0.0), index=idx, geometry=geometry))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_a_refused_checkpoint_changes_nothing(store):
    idx = torch.tensor([2, 3, 5, 8])
    student, flat = student_and_rela(store, dense=False)
    flat.wrap(torch.tensor(0.0), index=idx, features=student(images(idx)))
    student, rela = student_and_rela(store, seed=5)
    rela.wrap(torch.tensor(0.0), index=idx, features=student(images(idx)))
    before = rela.head.weight.clone()
    with pytest.raises(ValueError, match="without a dense term"):
        rela.load_state_dict(flat.state_dict())
    assert torch.equal(rela.head.weight, before)
    with pytest.raises(ValueError, match="head_in_ddp=False"):
        ReLA(store, student, dense=student.features, feature_dim=16, head_in_ddp=True, witness=False)


def test_dense_only_pulls_the_student_by_the_dense_term_alone(store):
    """dense_only=True: the loss is the dense term of the captured map, no gradient reaches a layer only the global
    features pass through (it does with both terms), and the global head still learns."""
    idx = torch.tensor([2, 3, 8, 11, 17, 21])
    x = images(idx)

    class WithProjection(torch.nn.Module):  # the global features go through a layer the map does not
        def __init__(self):
            super().__init__()
            self.convnet = ConvNet(widths=(8, 16))
            self.features, self.project = self.convnet.features, torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.project(self.convnet(x))

    def run(dense_only):
        torch.manual_seed(0)
        student = WithProjection()
        rela = ReLA(store, student, dense=student.features, dense_only=dense_only, dataset=tiny_dataset(N),
                    feature_dim=16, n_components=4, total_steps=50, witness=False, schedule="constant:1")
        rela.wrap(torch.tensor(0.0), index=idx, features=student(x))  # the heads' least-squares start
        maps = []
        hook = student.features.register_forward_hook(lambda m, a, out: maps.append(out.detach()))
        loss = rela.wrap(torch.tensor(0.0), index=idx, features=student(x))
        hook.remove()
        student.zero_grad()
        loss.backward()
        return student, rela, loss, maps[0]

    student, _, _, _ = run(False)
    assert student.project.weight.grad.abs().sum() > 0
    student, rela, loss, captured = run(True)
    # in the graph (DDP needs every parameter used), with a zero gradient
    assert student.project.weight.grad is not None and student.project.weight.grad.abs().sum() == 0
    assert student.features[0].weight.grad.abs().sum() > 0  # the map's layers: pulled by the dense term
    assert rela.head.weight.grad.abs().sum() > 0  # the global head learns, on detached features
    term = rela.priors["0"]
    pooled = F.adaptive_avg_pool2d(captured, (2, 2)).permute(0, 2, 3, 1).reshape(-1, 16)
    target = term.targets.reduce_raw(store.maps(idx).permute(0, 2, 3, 1).reshape(-1, 5), torch.device("cpu"))
    with torch.no_grad():
        dense = (1 - F.cosine_similarity(term.dense.linear(pooled), target, dim=1)).mean()
    torch.testing.assert_close(loss.detach(), dense, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"dense_only=True.*no dense= module"):
        ReLA(store, ConvNet(widths=(8, 16)), dense_only=True, feature_dim=16, witness=False)

"""Tiny BatchNorm teachers and data for the distillation tests (12 px, 4 classes, a few hundred weights)."""

import functools

import torch
import torch.nn.functional as F

from accelerate_ssl.backbones import ResNetSmall

SIZE, CLASSES = 12, 4
MEAN, STD = (0.5,), (0.25,)


def tiny_real(per_class: int = 3, seed: int = 0):
    """Images in [0, 1] whose class is a bright quadrant (0..3) over noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(CLASSES).repeat(per_class)
    images = torch.rand(len(labels), 1, SIZE, SIZE, generator=g) * 0.4
    h = SIZE // 2
    for i, c in enumerate(labels.tolist()):
        r, q = divmod(c, 2)
        images[i, :, r * h : (r + 1) * h, q * h : (q + 1) * h] += 0.5
    return images.clamp(0, 1), labels


def tiny_teacher(seed: int = 0, widths=(4, 8, 8), steps: int = 30) -> ResNetSmall:
    """A fresh copy of :func:`_trained` (cached): a tiny ResNetSmall trained briefly on :func:`tiny_real` data (input-sensitive logits, real BN stats)."""
    import copy

    return copy.deepcopy(_trained(seed, tuple(widths), steps))


@functools.lru_cache(maxsize=None)
def _trained(seed, widths, steps):
    g = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = ResNetSmall(in_channels=1, num_classes=CLASSES, widths=widths)
    x, y = tiny_real(per_class=16, seed=100 + seed)
    x = (x - MEAN[0]) / STD[0]
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    model.train()
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.random.set_rng_state(g)
    return model.eval()


def state_copy(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(model, saved):
    now = model.state_dict()
    assert now.keys() == saved.keys()
    for k in saved:
        assert torch.equal(now[k], saved[k]), f"{k} changed"


def one_thread():
    """Generator body for an autouse fixture: 1 intra-op thread (far faster for these tiny models on a
    shared, loaded machine), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

"""Helper for tests/test_precompute.py: one precompute run, launched as a script (plain or under
`accelerate launch`). Usage: python _precompute_worker.py OUT [--n N] [--chunk-size C] [--sleep S]."""

import argparse
import time

import numpy as np
import torch

from accelerate_ssl.data import ArrayImageDataset
from accelerate_ssl.targets.precompute import precompute_targets
from accelerate_ssl.priors import create_prior


def tiny_dataset(n: int) -> ArrayImageDataset:
    rng = np.random.default_rng(0)
    return ArrayImageDataset(rng.integers(0, 256, size=(n, 16, 16), dtype=np.uint8), rng.integers(0, 10, n), name="tiny")


class _Slow(torch.nn.Module):
    """Delays every forward (so a test can kill the run between chunks)."""

    def __init__(self, model, seconds):
        super().__init__()
        self.model, self.seconds = model, seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return self.model(x)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=96)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prior = create_prior("random:convnet")
    if args.sleep:
        prior.model = _Slow(prior.model, args.sleep)
    precompute_targets(prior, tiny_dataset(args.n), args.out, batch_size=args.batch_size, chunk_size=args.chunk_size,
                       progress=False)

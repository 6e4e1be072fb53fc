"""Messages that say what is actually wrong: a clean set in the right order inside another class. (The fixes that
errors name as commands are followed as written in test_fix_messages.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from accelerate_ssl import ReLA, create_prior, precompute_targets
from accelerate_ssl.data.datasets import ArrayImageDataset
from accelerate_ssl.targets.format import TargetStoreMismatchError

pytestmark = pytest.mark.usefixtures("cpu_one_thread")


class Wrapped(Dataset):
    """A user's wrapper around the very data set the store was computed on: the same items in the same order."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]


def test_a_clean_set_in_the_right_order_inside_another_class_is_told_what_is_wrong(tmp_path):
    """Before: refused with the fix "pass that same dataset", which the user had done."""
    data = ArrayImageDataset(np.random.default_rng(0).integers(0, 256, (40, 16, 16), dtype=np.uint8), np.zeros(40),
                             name="tiny")
    store = precompute_targets(create_prior("random:convnet"), data, tmp_path / "s", batch_size=8, progress=False)
    student = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten())
    with pytest.raises(TargetStoreMismatchError) as err:
        ReLA(store, student, dataset=Wrapped(data), feature_dim=4)
    message = str(err.value)
    assert "pass that same dataset" not in message
    assert re.search(r"cannot be compared with this dataset \(Wrapped\): the store identified its data set by every "
                     r"row of its samples' array \(\.data\), and this dataset is identified by sampled images", message)
    assert "even if they hold the same items in the same order" in message
    assert "dataset=wrapper.dataset" in message and "`data`" in message
    ReLA(store, student, dataset=Wrapped(data).dataset, feature_dim=4)  # the fix it names

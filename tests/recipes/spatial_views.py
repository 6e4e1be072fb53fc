# The README's "Spatial stores: a target for any crop" block in a runnable loop, at test size: 64 real Fashion-MNIST
# images, the shipped BYOL ConvNet as the prior (its 3x3 map), a small ConvNet student with a SimSiam-style loss, a few
# steps on the CPU. Every line of the README's block is a line of this script; "# test" lines only observe the run.

import torch
import torch.nn.functional as F
from torchvision import transforms as T

from accelerate_ssl import ReLA, create_prior, precompute_targets
from accelerate_ssl.backbones import ConvNet
from accelerate_ssl.data import FashionMNIST
from accelerate_ssl.targets.views import RecordGeometry

clean_train_set = FashionMNIST("train", limit=64)
prior = create_prior("shipped:fashion-mnist-byol-20k")
store = precompute_targets(prior, clean_train_set, "targets/spatial", spatial=32, dtype="float16")
view = RecordGeometry(T.RandomResizedCrop(28, scale=(0.25, 1.0)), T.RandomHorizontalFlip(), T.ToTensor())


class TwoViews(torch.utils.data.Dataset):
    """Yields (index, (view1, geometry1), (view2, geometry2)) for each image of the clean set."""

    def __len__(self):
        return len(clean_train_set)

    def __getitem__(self, index):
        image = clean_train_set[index][0]
        return index, view(image), view(image)


backbone = ConvNet(widths=(16, 32))
predictor = torch.nn.Linear(32, 32)
loader = torch.utils.data.DataLoader(TwoViews(), batch_size=16, shuffle=True)
rela = ReLA(store, backbone, dataset=clean_train_set, total_steps=len(loader))
opt = torch.optim.AdamW([*backbone.parameters(), *predictor.parameters()], lr=1e-3)  # ReLA trains its head itself
losses, carried, ran = [], [], []  # test
for index, (view1, geometry1), (view2, geometry2) in loader:
    feats = backbone(torch.cat([view1, view2]))  # one call on both views, stacked as the geometry is
    z1, z2 = feats.chunk(2)
    ssl_loss = -(F.cosine_similarity(predictor(z1), z2.detach()).mean() + F.cosine_similarity(predictor(z2), z1.detach()).mean()) / 2
    loss = rela.wrap(ssl_loss, index=index, geometry=torch.cat([geometry1, geometry2]))
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))  # test
    carried.append((index, geometry1, geometry2))  # test
    ran.append(rela.stats["loss_rela"] is not None)  # test: the term ran (until the schedule hands over)

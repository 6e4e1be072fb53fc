import json

import pytest
import torch
from torch import nn

from accelerate_ssl.backbones import ConvNet, ResNetSmall
from accelerate_ssl.distill import DistilledSet, SoftLabelStore, kd_loss, synthesize, train_student, warm_start
from accelerate_ssl.distill.relabel import apply_batch_params, epoch_batches, sample_batch_params
from accelerate_ssl.distill.synthesize import seeded_generator
from distill_helpers import CLASSES, MEAN, SIZE, STD, one_thread, tiny_real, tiny_teacher

_one_thread = pytest.fixture(autouse=True)(one_thread)


def _tiny_set(n_per_class=2):
    x, y = tiny_real(per_class=n_per_class, seed=5)
    return DistilledSet((x - MEAN[0]) / STD[0], y, {"mean": list(MEAN), "std": list(STD), "num_classes": CLASSES})


# ------------------------------------------------------------------------------------------------- relabel


def test_kd_loss_zero_for_equal_logits_and_positive_otherwise():
    logits = torch.randn(5, CLASSES) * 4
    assert abs(float(kd_loss(logits, logits.clone(), 20.0))) < 1e-7
    assert abs(float(kd_loss(logits, logits + 3.0, 1.0))) < 1e-6  # softmax is shift invariant
    assert float(kd_loss(logits, torch.randn(5, CLASSES) * 4, 1.0)) > 1e-3


@pytest.mark.parametrize("mix", ["cutmix", "mixup", "none"])
def test_fkd_replay_reproduces_the_stored_images_exactly(mix, tmp_path):
    teacher = tiny_teacher()
    distilled = _tiny_set()
    store = SoftLabelStore.build(distilled, teacher, epochs=2, batch_size=3, seed=7, mix=mix, progress=False)
    store = SoftLabelStore.load(store.save(tmp_path / "soft.pt"))
    for epoch in range(2):
        for b, idx in enumerate(epoch_batches(len(distilled), 3, 7, epoch)):
            params = sample_batch_params(len(idx), SIZE, seeded_generator(7, "aug", epoch, b), mix=mix)
            expected = apply_batch_params(distilled.images[idx], params)  # what the teacher labelled
            images, logits = store.replay(distilled, epoch, b)
            assert torch.equal(images, expected)
            assert torch.equal(store.replay(distilled, epoch, b)[0], images)
            with torch.no_grad():
                assert torch.equal(teacher(images).half().float(), logits)


def test_fkd_store_averages_several_teachers():
    t1, t2 = tiny_teacher(), tiny_teacher(seed=1, widths=(4, 4, 8))
    distilled = _tiny_set()
    store = SoftLabelStore.build(distilled, [t1, t2], epochs=1, batch_size=4, seed=0, progress=False)
    images, logits = store.replay(distilled, 0, 0)
    with torch.no_grad():
        mean = ((t1(images) + t2(images)) / 2).half().float()
    assert torch.allclose(mean, logits, atol=1e-2)


def test_student_training_from_store_and_online_kd_lowers_the_loss():
    teacher = tiny_teacher()
    distilled = _tiny_set(4)
    torch.manual_seed(0)
    student = ResNetSmall(1, CLASSES, (4, 8, 8))
    store = SoftLabelStore.build(distilled, teacher, epochs=2, batch_size=8, seed=0, progress=False)
    r = train_student(student, distilled, soft_labels=store, epochs=6, temperature=4.0, lr=0.01, progress=False)
    assert r["steps"] == 12
    assert sum(r["loss"][-4:]) < sum(r["loss"][:4])
    r2 = train_student(student, distilled, teachers=teacher, epochs=1, batch_size=8, progress=False)
    assert r2["steps"] == 2
    with pytest.raises(ValueError, match="not both"):
        train_student(student, distilled, teachers=teacher, soft_labels=store, progress=False)


# ------------------------------------------------------------------------------------------------- outputs


def test_outputs_png_class_folders_manifest_and_reload(tmp_path):
    teacher = tiny_teacher()
    out = tmp_path / "set"
    d = synthesize(teacher, method="dwa", ipc=2, real=tiny_real(), mean=MEAN, std=STD, iterations=3, seed=1,
                   out_dir=str(out), teacher_spec="tiny", progress=False)
    man = json.loads((out / "manifest.json").read_text())
    assert man["method"] == "dwa" and man["seed"] == 1 and man["ipc"] == 2
    assert man["hparams"]["rho"] == 0.015 and man["hparams"]["steps"] == 12 and man["hparams"]["iterations"] == 3
    assert man["teachers"][0]["spec"] == "tiny" and man["labels"] == d.labels.tolist()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [f"{c:03d}" for c in range(CLASSES)]
    assert len(list(out.glob("*/*.png"))) == 2 * CLASSES and not (out / ".partial").exists()
    again = DistilledSet.load(out)
    assert torch.equal(again.images, d.images) and torch.equal(again.labels, d.labels)
    (out / "images.pt").unlink()
    from_png = DistilledSet.load(out)  # PNG only: 8-bit quantised, de-normalised and re-normalised
    assert (from_png.images - d.images).abs().max() <= 0.5 / 255 / STD[0] + 1e-5
    from PIL import Image

    assert Image.open(next(out.glob("000/*.png"))).mode == "L"


def test_resume_after_interruption_equals_uninterrupted_run(tmp_path):
    teacher = tiny_teacher()
    kw = dict(method="dwa", ipc=3, real=tiny_real(), mean=MEAN, std=STD, iterations=4, seed=2, progress=False)
    full = synthesize(teacher, **kw)

    def stop_after_two(batch, images, history):
        if batch == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        synthesize(teacher, out_dir=str(tmp_path / "r"), callback=stop_after_two, **kw)
    assert len(list((tmp_path / "r" / ".partial").glob("batch_*.pt"))) == 2
    done = []
    resumed = synthesize(teacher, out_dir=str(tmp_path / "r"), callback=lambda b, i, h: done.append(b), **kw)
    assert done == [2]  # only the missing batch ran
    assert torch.equal(resumed.images, full.images)
    with pytest.raises(ValueError, match="different"):
        synthesize(teacher, out_dir=str(tmp_path / "r"), **dict(kw, seed=9))


def test_clear_errors_for_bad_inputs():
    teacher = tiny_teacher()
    with pytest.raises(ValueError, match="only 3 real image"):
        synthesize(teacher, method="sre2l++", ipc=4, real=tiny_real(per_class=3), mean=MEAN, std=STD, iterations=2, progress=False)
    x, y = tiny_real()
    with pytest.raises(ValueError, match="predicts 4 classes"):
        synthesize(teacher, method="sre2l++", ipc=1, real=(x, y), num_classes=5, mean=MEAN, std=STD, iterations=2, progress=False)
    with pytest.raises(ValueError, match="labels 0..2"):
        keep = y < 3
        synthesize(teacher, method="sre2l++", ipc=1, real=(x[keep], y[keep]), mean=MEAN, std=STD, iterations=2, progress=False)
    other = ResNetSmall(1, CLASSES + 1, (4, 4, 4))
    with pytest.raises(ValueError, match="different numbers of classes"):
        synthesize([teacher, other], method="fadrm+", ipc=1, real=(x, y), mean=MEAN, std=STD, iterations=4, progress=False)
    with pytest.raises(ValueError, match="real images"):
        synthesize(teacher, method="dwa", ipc=1, mean=MEAN, std=STD, iterations=2, progress=False)
    with pytest.raises(ValueError, match="Unknown hyper-parameter"):
        synthesize(teacher, method="sre2l", ipc=1, real=(x, y), mean=MEAN, std=STD, rho=0.1, progress=False)


# ------------------------------------------------------------------------------------------------- warm start + CLI


def test_warm_start_feature_backbone_gets_a_temporary_head():
    teacher = tiny_teacher()
    distilled = _tiny_set(3)
    backbone = ConvNet(1, (4, 8), norm="group")
    before = [p.detach().clone() for p in backbone.parameters()]
    r = warm_start(backbone, distilled, teacher=teacher, epochs=2, batch_size=6, progress=False)
    assert isinstance(r["head"], nn.Linear) and r["head"].out_features == CLASSES
    assert any(not torch.equal(a, b) for a, b in zip(before, backbone.parameters()))
    classifier = ResNetSmall(1, CLASSES, (4, 4, 4))
    r = warm_start(classifier, distilled, epochs=1, progress=False)  # hard labels, no head
    assert r["head"] is None and r["steps"] == 1


def test_cli_distill_runs_end_to_end(tmp_path, capsys):
    from accelerate_ssl.cli import main

    torch.manual_seed(0)
    teacher = ResNetSmall(1, 10, (4, 4, 8))
    torch.save(teacher.state_dict(), tmp_path / "t.pt")
    out = tmp_path / "out"
    rc = main(["distill", "--teacher", "random:resnet_small", "--weights", str(tmp_path / "t.pt"),
               "--teacher-kwargs", '{"widths": [4, 4, 8]}', "--data", "digits", "--method", "sre2l++", "--ipc", "1",
               "--iterations", "2", "--out", str(out), "--relabel-epochs", "1", "--no-progress", "--device", "cpu",
               "--json"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)  # --json: one object, nothing else on stdout
    assert printed["images"] == 10 and printed["method"] == "sre2l++" and printed["soft_labels"].endswith("soft_labels.pt")
    man = json.loads((out / "manifest.json").read_text())
    assert man["num_classes"] == 10 and len(man["files"]) == 10 and (out / "soft_labels.pt").exists()
    assert man["teachers"][0]["spec"].startswith("random:resnet_small:")

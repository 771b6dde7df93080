import torch
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.train.evaluate import evaluate, tta_views
from torchspeed.train.loop.metrics import DeviceMeter
from torchspeed.train.transfer import Prefetcher, loader_kwargs, to_device


class Asym(torch.nn.Module):
    """Logits that depend on left/right: flip-TTA must change them."""

    def forward(self, x):
        left, right = x[..., : x.shape[-1] // 2].mean((1, 2, 3)), x[..., x.shape[-1] // 2:].mean((1, 2, 3))
        return torch.stack([left, right], dim=1) * 10


def test_evaluate_runs_in_inference_mode_and_counts_accuracy():
    seen = {}

    class Spy(torch.nn.Module):
        def forward(self, x):
            seen["inference"] = torch.is_inference_mode_enabled()
            seen["training"] = self.training
            return torch.nn.functional.one_hot(torch.zeros(len(x), dtype=torch.long), 2).float()

    ds = TensorDataset(torch.randn(10, 1, 4, 4), torch.tensor([0] * 7 + [1] * 3))
    m = Spy()
    m.train()
    out = evaluate(m, DataLoader(ds, batch_size=4), device="cpu")
    assert seen == {"inference": True, "training": False}
    assert m.training  # restored
    assert abs(out["val_acc"] - 0.7) < 1e-9 and out["samples"] == 10


def test_flip_tta_averages_mirrored_views():
    x = torch.zeros(4, 1, 4, 4)
    x[..., :2] = 1.0  # bright left half: class 0 without TTA
    y = torch.tensor([1, 1, 1, 1])
    ds = DataLoader(TensorDataset(x, y), batch_size=4)
    plain = evaluate(Asym(), ds, device="cpu")
    tta = evaluate(Asym(), ds, device="cpu", tta="flip")
    assert plain["val_acc"] == 0.0
    # with the mirror, both classes get equal probability: loss becomes log(2)
    assert abs(tta["val_loss"] - torch.log(torch.tensor(2.0)).item()) < 1e-5
    views = tta_views(torch.randn(2, 3, 8, 8), flip=True, scales=(0.5, 1.0, 1.5))
    assert [tuple(v.shape[-2:]) for v in views] == [(8, 8), (8, 8), (4, 4), (12, 12)]
    torch.testing.assert_close(views[1], views[0].flip(-1))


def test_device_meter_matches_python_sums():
    meter = DeviceMeter("cpu")
    losses, ns = [0.5, 1.5, 2.0], [4, 4, 2]
    for loss, n in zip(losses, ns):
        meter.update(torch.tensor(loss), n=n, correct=torch.tensor(n // 2))
    out = meter.compute()
    assert abs(out["loss"] - sum(l * n for l, n in zip(losses, ns)) / 10) < 1e-12
    assert abs(out["acc"] - 5 / 10) < 1e-12


def test_to_device_moves_nested_batches_and_prefetcher_passthrough_on_cpu():
    batch = (torch.randn(2, 3, 4, 4), {"y": torch.tensor([1, 2])}, "meta")
    out = to_device(batch, torch.device("cpu"), channels_last=True)
    assert out[0].is_contiguous(memory_format=torch.channels_last)
    assert out[2] == "meta" and torch.equal(out[1]["y"], torch.tensor([1, 2]))
    loader = DataLoader(TensorDataset(torch.arange(8.0).view(8, 1), torch.arange(8)), batch_size=4)
    p = Prefetcher(loader, "cpu")
    assert p.mode == "passthrough" and len(p) == 2
    assert [b[1].tolist() for b in p] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert loader_kwargs("cpu", num_workers=0) == {"num_workers": 0, "pin_memory": False}
    assert loader_kwargs("cuda", num_workers=2)["pin_memory"] is True


def test_to_device_moves_lists_of_images_and_target_dicts_element_by_element():
    images = (torch.rand(3, 8, 10), torch.rand(3, 12, 9))  # variable sizes: no batch tensor
    targets = [{"boxes": torch.zeros(1, 4), "labels": torch.tensor([1])}, {"boxes": torch.zeros(2, 4),
                                                                        "labels": torch.tensor([2, 1])}]
    moved = to_device((images, targets), torch.device("meta"), channels_last=True)
    assert isinstance(moved, tuple) and isinstance(moved[0], tuple) and isinstance(moved[1], list)
    assert [tuple(im.shape) for im in moved[0]] == [(3, 8, 10), (3, 12, 9)]
    assert all(im.is_meta for im in moved[0]) and all(v.is_meta for t in moved[1] for v in t.values())
    assert [sorted(t) for t in moved[1]] == [["boxes", "labels"]] * 2 and tuple(moved[1][1]["boxes"].shape) == (2, 4)


def test_to_device_moves_mappings_that_are_not_dicts():
    from collections import UserDict

    class Encoding(UserDict):  # as Hugging Face's BatchEncoding
        pass

    moved = to_device(Encoding(input_ids=torch.ones(2, 3, dtype=torch.long)), torch.device("meta"))
    assert moved["input_ids"].is_meta

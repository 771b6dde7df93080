"""CUDA paths: run with `pytest -m gpu` on a GPU machine (skipped elsewhere)."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.train import Prefetcher, Trainer, TrainConfig
from torchspeed.train.backends import configure_backends
from torchspeed.train.step import backward, optimizer_step

pytestmark = pytest.mark.gpu


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_fp16_scaler_on_cuda_unscales_before_clipping():
    x, y = torch.randn(32, 16, device="cuda"), torch.randint(0, 4, (32,), device="cuda")
    ref = _mlp().cuda()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    m = _mlp().cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cuda")
    backward(torch.nn.functional.cross_entropy(m(x), y), scaler=scaler)
    assert int(optimizer_step(opt, scaler=scaler, clip_grad_norm=0.05, parameters=m.parameters())) == 0
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_prefetcher_uses_a_side_stream_and_keeps_order():
    ds = TensorDataset(torch.arange(64.0).view(64, 1), torch.arange(64))
    loader = DataLoader(ds, batch_size=8, pin_memory=True)
    p = Prefetcher(loader, "cuda")
    assert p.mode == "cuda-stream"
    got = [b[1].cpu().tolist() for b in p]
    assert sum(got, []) == list(range(64))


def test_cudnn_benchmark_and_tf32_switched_on():
    applied = configure_backends("cuda", fixed_shapes=True)
    assert torch.backends.cudnn.benchmark and applied["cudnn_benchmark"]
    assert torch.backends.cuda.matmul.allow_tf32


def test_fp16_trainer_counts_skipped_steps():
    t = Trainer(_mlp(), device="cuda", config=TrainConfig(precision="fp16", compile=False, progress=False,
                                                           schedule=None))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    t.train_step((x.cuda() * float("inf"), y.cuda()))
    t.train_step((x.cuda(), y.cuda()))
    assert int(t.skipped) == 1

"""CUDA paths: run with `pytest -m gpu` on a GPU machine (skipped elsewhere)."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train import Prefetcher, Trainer, TrainConfig
from torchspeed.train.trial.backends import configure_backends
from torchspeed.train.loop.step import backward, optimizer_step

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
    assert applied["tf32"].value
    assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"  # still readable
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9 maps the flag onto the per-backend setting
        assert torch.backends.cuda.matmul.fp32_precision == "tf32" and torch.backends.cudnn.conv.fp32_precision == "tf32"


def test_fp16_trainer_counts_skipped_steps():
    t = Trainer(_mlp(), device="cuda", config=TrainConfig(precision="fp16", compile=False, progress=False,
                                                           schedule=None))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    t.train_step((x.cuda() * float("inf"), y.cuda()))
    t.train_step((x.cuda(), y.cuda()))
    assert int(t.skipped) == 1


def _conv():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
                               torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(16, 4))


def test_bf16_fused_skips_a_nan_step_on_the_device_without_touching_weights():
    """The "device" guard: the fused kernel reads found_inf, so a NaN loss changes nothing and costs no sync."""
    t = Trainer(_mlp(), device="cuda", config=TrainConfig(precision="bf16", compile=False, progress=False,
                                                           schedule=None, log_every=100))
    assert t.guard.mode == "device"
    before = [p.detach().clone() for p in t.module.parameters()]
    x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 4, (8,), device="cuda")
    t.train_step((x * float("nan"), y))
    assert int(t.skipped) == 1
    for a, b in zip(before, t.module.parameters()):
        assert torch.equal(a, b)
    t.train_step((x, y))
    assert int(t.skipped) == 1 and any(not torch.equal(a, b) for a, b in zip(before, t.module.parameters()))


def test_compile_auto_trial_on_cuda_tries_default_and_cuda_graphs():
    ds = TensorDataset(torch.randn(512, 3, 16, 16), torch.randint(0, 4, (512,)))
    res = torchspeed.fit(_conv(), DataLoader(ds, batch_size=16, drop_last=True), epochs=1, compile="auto",
                         progress=False, compile_min_run_s=0, device="cuda", schedule=None)
    detail = res.decisions["compile"].measured
    assert detail["compiled_s"] > 0 and detail["compile_s"] > 0, detail
    assert "default" in detail["reason"] and "reduce-overhead" in detail["reason"], detail  # both modes timed
    assert res.history[-1]["train_loss"] == res.history[-1]["train_loss"]  # finite, not NaN


def test_cuda_graphs_training_matches_eager():
    ds = TensorDataset(torch.randn(256, 3, 16, 16), torch.randint(0, 4, (256,)))
    losses = {}
    for mode in (False, "reduce-overhead"):
        kw = dict(compile=False) if mode is False else dict(compile=True, compile_mode=mode)
        res = torchspeed.fit(_conv(), DataLoader(ds, batch_size=32, drop_last=True), epochs=3, progress=False,
                             device="cuda", schedule=None, precision="fp32", channels_last=False, seed=0, **kw)
        losses[mode] = [h["train_loss"] for h in res.history]
        if mode:
            assert "mode=reduce-overhead" in res.decisions["compile"].reason
    assert losses["reduce-overhead"] == pytest.approx(losses[False], rel=2e-3)
    assert losses[False][-1] < losses[False][0]


def test_out_of_memory_in_a_step_names_the_fix_and_training_goes_on():
    from torchspeed.train import TrainingOutOfMemoryError

    t = Trainer(_conv(), device="cuda", config=TrainConfig(compile=False, progress=False, schedule=None))
    free, _ = torch.cuda.mem_get_info()
    half = int(free // (3 * 256 * 256 * 4) // 6)  # the input fits (1/6 of free memory); 16-channel activations do not
    x = torch.randn(half, 3, 256, 256, device="cuda")
    with pytest.raises(TrainingOutOfMemoryError, match="batch_size=.*grad_accum"):
        t.step_batch((x, torch.zeros(half, dtype=torch.long, device="cuda")))
    del x
    torch.cuda.empty_cache()
    t.step_batch((torch.randn(8, 3, 32, 32, device="cuda"), torch.zeros(8, dtype=torch.long, device="cuda")))
    assert t.step == 1


def test_checkpoint_resume_restores_the_cuda_rng(tmp_path):
    from torchspeed.train.state.rng import capture_rng_state, restore_rng_state

    torch.cuda.manual_seed(123)
    state = capture_rng_state()
    a = torch.rand(4, device="cuda")
    torch.rand(100, device="cuda")
    restore_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), a)

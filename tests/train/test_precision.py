import pytest
import torch

from torchspeed.env import detect
from torchspeed.train.trial.precision import make_grad_scaler, resolve_precision


@pytest.mark.capability
def test_auto_picks_bf16_exactly_when_the_cpu_has_bf16(cpu_profile):
    p = resolve_precision("auto", device="cpu")
    assert detect().bf16_supported == (cpu_profile in ("avx512_bf16", "amx"))
    assert p.name == ("bf16" if cpu_profile in ("avx512_bf16", "amx") else "fp32")


def test_explicit_precisions_and_aliases():
    assert resolve_precision("bf16-mixed", device="cpu").dtype is torch.bfloat16
    assert resolve_precision("fp32", device="cpu").dtype is None
    assert resolve_precision("fp16", device="cpu").needs_scaler
    with pytest.raises(ValueError, match="not one of"):
        resolve_precision("int8", device="cpu")


def test_bf16_autocast_really_runs_matmuls_in_bf16():
    p = resolve_precision("bf16", device="cpu")
    lin = torch.nn.Linear(4, 4)
    with p.autocast():
        out = lin(torch.randn(2, 4))
    assert out.dtype is torch.bfloat16
    with resolve_precision("fp32", device="cpu").autocast():
        assert lin(torch.randn(2, 4)).dtype is torch.float32


def test_scaler_only_for_fp16():
    assert make_grad_scaler(resolve_precision("bf16", device="cpu")) is None
    assert isinstance(make_grad_scaler(resolve_precision("fp16", device="cpu")), torch.amp.GradScaler)


@pytest.mark.gpu
def test_auto_on_cuda_matches_compute_capability():
    p = resolve_precision("auto", device="cuda")
    cc = torch.cuda.get_device_capability()
    assert p.name == ("bf16" if cc >= (8, 0) else "fp16")

"""TF32 through one API: the legacy flags, which torch.get_float32_matmul_precision() can read (Lightning
reads it), and the per-backend fp32_precision settings only where the process already uses them."""

from types import SimpleNamespace as NS

import pytest
import torch

from torchspeed.train.trial.backends import enable_tf32


class _Mixed:
    """A backend whose legacy flag no longer reads: the per-backend API was written in this process."""

    fp32_precision = "ieee"

    @property
    def allow_tf32(self):
        raise RuntimeError("mix of the legacy and new APIs")


def test_tf32_sets_the_legacy_flags_that_every_reader_can_read():
    b = NS(cuda=NS(matmul=NS(allow_tf32=False, fp32_precision="none")),
           cudnn=NS(allow_tf32=False, conv=NS(fp32_precision="none"), rnn=NS(fp32_precision="none")))
    how = enable_tf32(b)
    assert b.cuda.matmul.allow_tf32 and b.cudnn.allow_tf32 and "allow_tf32" in how
    assert b.cuda.matmul.fp32_precision == "none"  # the per-backend API left alone: no mixed state


def test_tf32_uses_the_per_backend_settings_where_the_process_already_uses_them():
    b = NS(cuda=NS(matmul=_Mixed()), cudnn=NS(conv=NS(fp32_precision="none"), rnn=NS(fp32_precision="none")))
    how = enable_tf32(b)
    assert (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision) == ("tf32",) * 3
    assert "fp32_precision" in how


def test_tf32_on_this_torch_leaves_the_matmul_precision_readable():
    """The GPU check's Lightning row failed with "mix of the legacy and new APIs" after fit set TF32 per backend."""
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        saved = (m.allow_tf32, c.allow_tf32)
    except RuntimeError:
        pytest.skip("an earlier test left this process on the per-backend API")
    try:
        enable_tf32()
        assert torch.get_float32_matmul_precision() == "high" and m.allow_tf32
        if hasattr(m, "fp32_precision"):
            assert m.fp32_precision == "tf32"  # torch maps the legacy flag onto the per-backend setting
    finally:
        m.allow_tf32, c.allow_tf32 = saved


# ------------------------------------------------------------------ no autotuning for shapes that run once
_SEEN: list = []  # outside the model: the switch trial puts back what a measuring pass writes on it


class _SeesAutotune(torch.nn.Module):
    """Records cudnn.benchmark at each forward (a flag torch keeps on every build, CUDA or not)."""

    seen = property(lambda self: _SEEN)

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        _SEEN.clear()

    def forward(self, x):
        self.seen.append((x.shape[0], torch.backends.cudnn.benchmark))
        return self.lin(x)


def test_no_autotune_turns_cudnn_benchmark_off_inside_and_restores_it_after_an_error():
    from torchspeed.train.trial.backends import no_autotune

    before = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = True
        with pytest.raises(RuntimeError):
            with no_autotune():
                assert torch.backends.cudnn.benchmark is False
                raise RuntimeError("a probe failed")
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = before


def test_the_plans_odd_shaped_probes_run_without_autotuning_and_training_with_it(monkeypatch):
    """The recipe's classifier check (2 samples), the noise scale's half batches and the switch trial's numerics
    guard run at shapes the run never trains at: cuDNN must not autotune them (seconds each in a fresh GPU process);
    the training steps keep the run's setting."""
    import torchspeed
    from torch.utils.data import DataLoader, TensorDataset
    from torchspeed.env import DeviceCaps
    from torchspeed.plan.recipe import is_classifier
    from torchspeed.train.trial.autoswitch import SwitchStage
    from torchspeed.train.noise import measure_noise_scale

    before = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = True
        model = _SeesAutotune()
        x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
        assert is_classifier(model, (x[:16], y[:16]))
        measure_noise_scale(model, [(x[:16], y[:16])], batches=1)
        assert model.seen and all(flag is False for _, flag in model.seen)
        assert torch.backends.cudnn.benchmark is True
        model.seen.clear()
        guard = []
        real = SwitchStage._numerics_losses
        monkeypatch.setattr(SwitchStage, "_numerics_losses", lambda self, batch: guard.append(
            len(model.seen)) or real(self, batch))
        caps = DeviceCaps("cpu", "bf16", True, (), frozenset({"cpu_bf16_fast"}))
        monkeypatch.setattr(DeviceCaps, "of", classmethod(lambda cls, dev: caps))
        torchspeed.fit(model, DataLoader(TensorDataset(x, y), batch_size=16), epochs=2, lr=0.1, progress=False,
                       compile=False, cudnn_benchmark=True, malloc=False)
        assert guard, "the trial tried another precision: its guard ran"
        probes = [flag for n, flag in model.seen if n != 16]  # the guard's few samples
        steps = [flag for n, flag in model.seen if n == 16]
        assert probes and not any(probes) and steps and all(steps)
    finally:
        torch.backends.cudnn.benchmark = before

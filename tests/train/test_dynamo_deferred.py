"""`fit` makes and steps its optimizer without importing torch._dynamo (train/trial/dynamo_deferred.py), and the
updates are torch's own, bit for bit."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from torchspeed.train.trial import dynamo_deferred
from torchspeed.train.trial.dynamo_deferred import deferred_dynamo, torch_step, torch_zero_grad


def test_fit_in_a_fresh_process_never_imports_torch_dynamo_and_trains_as_torchs_adamw():
    """A fresh interpreter: `fit` with the script's AdamW and LR leaves torch._dynamo unimported, and its weights
    equal a plain loop's with `torch.optim.AdamW` (which imports it) to the last bit."""
    code = textwrap.dedent("""
        import sys, torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        import torchspeed
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(256, 8, generator=g), torch.randint(0, 3, (256,), generator=g)
        def model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        m = model()
        torchspeed.fit(m, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False), epochs=2,
                       optimizer="adamw", lr=1e-2, weight_decay=0.0, progress=False,
                       precision="fp32", compile=False)  # on every CPU: no trial of bf16 (which rounds otherwise)
        assert "torch._dynamo" not in sys.modules, "fit imported torch._dynamo"
        ref = model()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
        for _ in range(2):
            for i in range(0, 256, 32):
                opt.zero_grad()
                nn.functional.cross_entropy(ref(x[i:i + 32]), y[i:i + 32]).backward()
                opt.step()
        assert "torch._dynamo" in sys.modules  # torch's own optimizer does import it
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values()))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_the_switch_trials_turns_timed_apart_do_not_import_torch_dynamo_either(tmp_path):
    """A fresh interpreter on a CPU with native bf16 (injected): the trial times bf16 apart (`ShadowTurns.step`,
    which puts the gradients back after the candidate's forward and backward) under `recipe="auto"`'s
    Schedule-Free AdamW, and `torch._dynamo` stays unimported (its `zero_grad` there imported it: 1 s a run)."""
    code = textwrap.dedent("""
        import sys, torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        import torchspeed
        from torchspeed.train.trial import shadow
        turns = []
        step = shadow.ShadowTurns.step
        shadow.ShadowTurns.step = lambda self, *a, **k: turns.append(1) or step(self, *a, **k)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(8192, 8, generator=g), torch.randint(0, 3, (8192,), generator=g)
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        # 1,024 steps: long enough to afford bf16's first use (`switches.FIRST_SWITCH_S`) on any CPU
        torchspeed.fit(m, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), epochs=2,
                       optimizer="adamw", recipe="auto", progress=False, compile=False)
        assert turns, "no turn was timed apart: the test does not reach ShadowTurns.step"
        assert "torch._dynamo" not in sys.modules, "fit imported torch._dynamo"
        print("ok")
    """)
    env = {**os.environ, "TORCHSPEED_CPU_PROFILE": "avx512_bf16", "TORCHSPEED_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_the_kernel_trial_and_the_checkpoints_of_a_default_fit_do_not_import_torch_dynamo(tmp_path):
    """A fresh interpreter (an AVX2 CPU injected): `fit` with nothing said (SGD, its kernel measured by the trial's optimizer-kernel
    stage, which times the step without step hooks) and a checkpoint each epoch (the optimizer's state_dict)
    leaves `torch._dynamo` unimported; before, each of the two imported it."""
    code = textwrap.dedent(f"""
        import sys, torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        import torchspeed
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(512, 8, generator=g), torch.randint(0, 3, (512,), generator=g)
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        r = torchspeed.fit(m, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), epochs=2,
                           progress=False, compile=False, checkpoint_dir={str(tmp_path / "ckpt")!r},
                           trial_share=float("inf"))  # unpriced, as conftest leaves tests: the kernel stage runs
        stages = [s["stage"] for s in (r.decisions["switch_trial"].measured or {{}}).get("stages", [])]
        assert "optimizer kernel" in stages, stages
        assert "torch._dynamo" not in sys.modules, "fit imported torch._dynamo"
        print("ok")
    """)
    # a CPU without native bf16 (injected): fp32 has no rival, so the trial goes on to the kernel stage on every
    # CPU (with bf16 a 64-step run's trial can end at the first stage: on AMX it does)
    env = {**os.environ, "TORCHSPEED_CPU_PROFILE": "avx2", "TORCHSPEED_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("make", [lambda p: torch.optim.Adam(p, lr=1e-2),
                                  lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, amsgrad=True),
                                  lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
                                  lambda p: torch.optim.SGD(p, lr=0.1)])
def test_the_step_without_the_wrapper_is_torchs_step_bit_for_bit(monkeypatch, make):
    """`torch_step` (the step without torch's wrapper, its import included) against `optimizer.step()`, over
    three steps from a fresh state; and it leaves the state torch's next step expects."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    b = copy.deepcopy(a)
    opt_a, opt_b = make(a.parameters()), make(b.parameters())
    calls = []  # torch's wrapper around every step calls `_optimizer_step_code` (a hook point for profilers)
    monkeypatch.setattr(torch.optim.Optimizer, "_optimizer_step_code", lambda self: calls.append(1))
    x = torch.randn(16, 6)
    for _ in range(3):
        for m, opt, lean_path in ((a, opt_a, True), (b, opt_b, False)):
            m(x).square().mean().backward()
            if lean_path:
                torch_step(opt)
            else:
                opt.step()
            opt.zero_grad()
    assert len(calls) == 3  # only b's steps went through torch's wrapper
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for p, q in zip(a.parameters(), b.parameters()):
        assert all(torch.equal(opt_a.state[p][k], opt_b.state[q][k]) for k in opt_b.state[q])


def _same(a, b) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return torch.equal(a.to_dense(), b.to_dense()) if a.is_sparse else torch.equal(a, b)


class _Bag(nn.Module):
    """An embedding model whose gradients are sparse (sparse=True) or dense."""

    def __init__(self, sparse: bool):
        super().__init__()
        self.e = nn.Embedding(50, 4, sparse=sparse)

    def forward(self, i):
        return self.e(i).sum(1)


@pytest.mark.parametrize("name, make, sparse", [
    ("SparseAdam", lambda p: torch.optim.SparseAdam(p, lr=1e-2), True),
    ("sparse SGD", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), True),
    ("Adadelta", lambda p: torch.optim.Adadelta(p, lr=1.0), False),
    ("RMSprop", lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9), False),
    ("Adagrad", lambda p: torch.optim.Adagrad(p, lr=1e-2), True),
    ("NAdam", lambda p: torch.optim.NAdam(p, lr=1e-2), False)])
def test_torchs_other_optimizers_step_without_the_wrapper_bit_for_bit(monkeypatch, name, make, sparse):
    """Every torch.optim optimizer (here with torch._dynamo imported, as a script that built its optimizer has it)
    steps through `torch_step` without torch's per-step wrapper, to the same bits and state as `step()`; a sparse
    gradient, which `LeanStep` leaves to torch, too. Fails where torch_step calls `step()` for these."""
    import torch._dynamo  # noqa: F401  (what a ported script's optimizer construction imported)

    torch.manual_seed(0)
    a = _Bag(sparse)
    b = copy.deepcopy(a)
    opt_a, opt_b = make(a.parameters()), make(b.parameters())
    calls = []
    monkeypatch.setattr(torch.optim.Optimizer, "_optimizer_step_code", lambda self: calls.append(1))
    for _ in range(3):
        i = torch.randint(0, 50, (8, 3))
        for m, opt, bare in ((a, opt_a, True), (b, opt_b, False)):
            m(i).square().mean().backward()
            torch_step(opt) if bare else opt.step()
            opt.zero_grad()
    assert len(calls) == 3, name  # only b's steps went through torch's wrapper
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for p, q in zip(a.parameters(), b.parameters()):
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys() and all(_same(sa[k], sb[k]) for k in sb)


def test_the_step_is_found_inside_dynamos_disable_too(monkeypatch):
    """Once something compiled, torch puts dynamo's `disable` around some optimizers' steps (SparseAdam's): the
    layers read the same, and the step still runs without the wrapper."""
    import torch._dynamo

    use_grad = torch.optim.Adagrad.step.__wrapped__  # under torch's hooks wrapper: `_use_grad`, then the step
    monkeypatch.setattr(torch.optim.Adagrad, "step",
                        torch.optim.Optimizer.profile_hook_step(torch._dynamo.disable(use_grad)))
    assert dynamo_deferred.bare_step(torch.optim.Adagrad) is use_grad.__wrapped__
    monkeypatch.setattr(torch.optim.Adagrad, "step", torch.optim.Optimizer.profile_hook_step(
        torch._dynamo.disable(use_grad.__wrapped__)))  # no grad layer left: not torch's step as it stands
    assert dynamo_deferred.bare_step(torch.optim.Adagrad) is None


def test_the_naive_loop_a_profiler_and_a_users_own_step_keep_torchs_wrapper(monkeypatch):
    """`step_with_torch` (TrainConfig(lean_step=False): the naive row costs what a script's loop costs), a profiler
    recording (its trace names the step) and an optimizer class of the user's: `step()` runs, wrapper and all."""
    from torchspeed.train.loop.lean_step import step_with_torch

    m = nn.Linear(3, 1)
    calls = []
    monkeypatch.setattr(torch.optim.Optimizer, "_optimizer_step_code", lambda self: calls.append(1))

    def one(opt):
        m(torch.randn(4, 3)).sum().backward()
        torch_step(opt)
        opt.zero_grad()

    naive = torch.optim.RMSprop(m.parameters(), lr=1e-2)
    step_with_torch(naive)
    one(naive)
    assert calls == [1]
    with torch.autograd.profiler.profile():
        one(torch.optim.RMSprop(m.parameters(), lr=1e-2))
    assert calls == [1, 1]
    one(torch.optim.RMSprop(m.parameters(), lr=1e-2))  # nothing around it: no wrapper
    assert calls == [1, 1]

    class Mine(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    p.add_(p.grad, alpha=-g["lr"])

    one(Mine(m.parameters()))
    assert calls == [1, 1, 1]


def test_a_step_with_something_around_it_goes_through_torch(monkeypatch):
    """A step hook (what the lean path leaves out) or a subclass: `optimizer.step()` itself runs."""
    m = nn.Linear(3, 1)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    seen = []
    opt.register_step_post_hook(lambda *_: seen.append(1))
    m(torch.randn(4, 3)).sum().backward()
    torch_step(opt)
    assert seen == [1]

    class MyAdam(torch.optim.Adam):
        pass

    opt2 = MyAdam(m.parameters(), lr=1e-2)
    stepped = []
    monkeypatch.setattr(MyAdam, "step", lambda self, *a, **k: stepped.append(1))
    torch_step(opt2)
    assert stepped == [1]


def test_deferred_dynamo_leaves_torchs_methods_as_they_were(monkeypatch):
    """Inside: the four dynamo-disabled methods call themselves (no import); outside: torch's cache as before."""
    monkeypatch.setattr(dynamo_deferred, "dynamo_imported", lambda: False)
    raws = [torch.optim.Optimizer.__dict__[n].__wrapped__ for n in dynamo_deferred._METHODS]
    before = [r.__dict__.get("__dynamo_disable") for r in raws]
    with deferred_dynamo():
        for r, was in zip(raws, before):
            assert r.__dict__.get("__dynamo_disable") is (was if was is not None else r)
        m = nn.Linear(2, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(torch.ones(1, 2)).sum().backward()
        torch_zero_grad(opt)
        assert m.weight.grad is None and opt.state_dict()["param_groups"][0]["lr"] == 0.1
    assert [r.__dict__.get("__dynamo_disable") for r in raws] == before

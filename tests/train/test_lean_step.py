"""LeanStep: torch's Adam/AdamW/SGD update on kept lists (fused, foreach or the default for-loop), bit for bit, and
every other case handed back."""

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train.loop.lean_step import lean_step_for
from torchspeed.train.optim_kernel import zero_grad
from torchspeed.train.loop.step import optimizer_step


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))


def _batches(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 1, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def _train(model, opt, batches, *, ours: bool, sched=None, between=None):
    for i, (x, y) in enumerate(batches):
        F.cross_entropy(model(x), y).backward()
        if ours:
            optimizer_step(opt)
            zero_grad(opt)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        if between is not None:
            between(i)


def _same(a: nn.Module, b: nn.Module, oa, ob) -> None:
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
        for k, v in oa.state[pa].items():
            assert torch.equal(v, ob.state[pb][k]), k


@pytest.mark.parametrize("kind,kw", [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
    (torch.optim.Adam, dict(lr=3e-3, weight_decay=1e-3)),
    (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, maximize=True, betas=(0.8, 0.95), eps=1e-6)),
    (torch.optim.Adam, dict(lr=torch.tensor(2e-3))),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, maximize=True)),
    (torch.optim.SGD, dict(lr=0.1)),
])
def test_the_lean_update_is_torchs_fused_update_bit_for_bit(kind, kw):
    ref, mine = _model(), _model()
    kw_ref = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kw.items()}
    o_ref, o_mine = kind(ref.parameters(), fused=True, **kw_ref), kind(mine.parameters(), fused=True, **kw)
    s_ref = torch.optim.lr_scheduler.StepLR(o_ref, 3, gamma=0.5) if not torch.is_tensor(kw["lr"]) else None
    s_mine = torch.optim.lr_scheduler.StepLR(o_mine, 3, gamma=0.5) if s_ref is not None else None
    batches = _batches()
    _train(ref, o_ref, batches, ours=False, sched=s_ref)
    _train(mine, o_mine, batches, ours=True, sched=s_mine)
    _same(ref, mine, o_ref, o_mine)
    stateless = kind is torch.optim.SGD and not kw.get("momentum")  # plain SGD has no state to make first
    assert lean_step_for(o_mine).steps == len(batches) - (0 if stateless else 1)  # torch makes the state


@pytest.mark.parametrize("kernel", [{}, dict(foreach=False), dict(foreach=True)])
@pytest.mark.parametrize("kind,kw", [
    (torch.optim.Adam, dict(lr=1e-2)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
    (torch.optim.Adam, dict(lr=3e-3, weight_decay=1e-3, betas=(0.8, 0.95), eps=1e-6)),
    (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, maximize=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, maximize=True)),
    (torch.optim.SGD, dict(lr=0.1)),
])
def test_the_lean_update_is_torchs_default_for_loop_update_bit_for_bit(kind, kw, kernel):
    """A script's `torch.optim.Adam(params, lr)` steps with the for-loop on the CPU; the lean step runs torch's
    foreach ops on kept lists, and must give the for-loop's numbers exactly (a ported run keeps its results)."""
    ref, mine = _model(), _model()
    o_ref = kind(ref.parameters(), foreach=False, **kw)  # the for-loop, whatever `kernel` the lean one was built with
    o_mine = kind(mine.parameters(), **kernel, **kw)
    s_ref, s_mine = (torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5) for o in (o_ref, o_mine))
    batches = _batches()
    _train(ref, o_ref, batches, ours=False, sched=s_ref)
    _train(mine, o_mine, batches, ours=True, sched=s_mine)
    _same(ref, mine, o_ref, o_mine)
    stateless = kind is torch.optim.SGD and not kw.get("momentum")
    assert lean_step_for(o_mine).steps == len(batches) - (0 if stateless else 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,kw", [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.Adam, dict(lr=1e-2, eps=1e-3)),  # fp16's eps: 1e-8 underflows, and NaN is equal to nothing
])
def test_half_precision_parameters_on_the_for_loop_are_torchs_to_step(kind, kw, dtype):
    """torch's foreach path rounds bf16/fp16 parameters otherwise than its for-loop (SGD's momentum step, Adam's on
    fp16): a model made half (`model.bfloat16()`) under a script's default optimizer keeps the for-loop's numbers,
    and the lean step makes none of its updates."""
    ref, mine = _model().to(dtype), _model().to(dtype)
    o_ref, o_mine = kind(ref.parameters(), **kw), kind(mine.parameters(), **kw)
    batches = [(x.to(dtype), y) for x, y in _batches()]
    _train(ref, o_ref, batches, ours=False)
    _train(mine, o_mine, batches, ours=True)
    _same(ref, mine, o_ref, o_mine)
    assert lean_step_for(o_mine).steps == 0


def test_the_lean_default_step_leaves_the_gradients_as_backward_wrote_them():
    """torch's foreach SGD adds nesterov's momentum into `p.grad` in place; the for-loop (a script's default) does
    not, and neither does the lean step: a callback reading the gradients after the step sees backward's."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    for x, y in _batches(3):
        F.cross_entropy(model(x), y).backward()
        before = [p.grad.clone() for p in model.parameters()]
        optimizer_step(opt)
        assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
        zero_grad(opt)
    assert lean_step_for(opt).steps == 2


def test_the_lists_are_made_in_the_first_step_so_the_second_carries_no_one_off_work(monkeypatch):
    """torch's first step makes the state; the lean lists (and the flat moments' copy) are made right after it, in
    that step, not in the second, which a switch trial times as the plain settings' first timed step."""
    from torchspeed.train.loop.lean_step import LeanStep

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    built = []
    real = LeanStep._build
    monkeypatch.setattr(LeanStep, "_build", lambda self: (built.append(len(opt.state)), real(self))[1])
    (x, y), *rest = _batches(3)
    F.cross_entropy(model(x), y).backward()
    optimizer_step(opt)  # no state yet (a build that finds none), torch's step makes it, then the lists
    n = len(list(model.parameters()))
    assert built == [0, n] and lean_step_for(opt).steps == 0
    zero_grad(opt)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (load_state_dict keeps the moment tensors)
    _train(model, opt, rest, ours=True)
    _train(ref, ref_opt, rest, ours=False)
    assert built == [0, n] and lean_step_for(opt).steps == 2  # the later steps lean, on the lists made then
    _same(model, ref, opt, ref_opt)


def test_where_the_lists_cannot_be_made_the_first_step_tries_once_more_and_no_later_step_does(monkeypatch):
    """A tensor LR on torch's default kernel (its foreach path refuses it): every step is torch's; `prepare` adds one
    try after the first step, not one a step on the hot path."""
    from torchspeed.train.loop.lean_step import LeanStep

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(2e-3))
    tries = []
    real = LeanStep._build
    monkeypatch.setattr(LeanStep, "_build", lambda self: (tries.append(1), real(self))[1])
    _train(model, opt, _batches(4), ours=True)
    assert lean_step_for(opt).steps == 0 and len(tries) == 4 + 1  # each step's own try, and prepare's one


def test_sparse_gradients_are_torchs_to_step_and_later_steps_do_not_look_again(monkeypatch):
    """An embedding with sparse=True under SGD with momentum: every step is torch's, bit for bit; once one sparse
    gradient was seen, the lean step hands back without walking the gradients (the list it builds is not made)."""
    from torchspeed.train.loop.lean_step import LeanStep

    def bag(seed=0):
        torch.manual_seed(seed)
        return nn.EmbeddingBag(40, 4, sparse=True)

    a, b = bag(), bag()
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (a, b))
    g = torch.Generator().manual_seed(3)
    steps = [torch.randint(0, 40, (8, 3), generator=g) for _ in range(5)]
    looked = []
    real = LeanStep._fresh
    monkeypatch.setattr(LeanStep, "_fresh", lambda self, **kw: (looked.append(kw), real(self, **kw))[1])
    for i in steps:
        for m, opt, ours in ((a, opt_a, True), (b, opt_b, False)):
            m(i).square().mean().backward()
            if ours:
                optimizer_step(opt)
                zero_grad(opt)
            else:
                opt.step()
                opt.zero_grad()
    assert torch.equal(a.weight, b.weight) and lean_step_for(opt_a).steps == 0
    assert sum(1 for kw in looked if kw.get("flags", True)) == 3  # step 1 and prepare (no state yet), step 2: no more


def test_two_groups_and_a_state_loaded_midway_stay_torchs_update():
    ref, mine = _model(), _model()

    def groups(m):
        return [{"params": list(m[0].parameters()), "lr": 1e-2},
                {"params": list(m[3].parameters()), "lr": 3e-3, "weight_decay": 0.0}]
    o_ref = torch.optim.AdamW(groups(ref), fused=True)
    o_mine = torch.optim.AdamW(groups(mine), fused=True)
    batches = _batches()
    saved = {}

    def reload(i, opt, key):
        if i == 4:
            saved[key] = copy.deepcopy(opt.state_dict())
        if i == 7:  # a resume: the state tensors are replaced; stale lists would update orphans
            opt.load_state_dict(saved[key])
    _train(ref, o_ref, batches, ours=False, between=lambda i: reload(i, o_ref, "ref"))
    _train(mine, o_mine, batches, ours=True, between=lambda i: reload(i, o_mine, "mine"))
    _same(ref, mine, o_ref, o_mine)
    assert lean_step_for(o_mine).steps == len(batches) - 1


def test_a_group_or_a_parameter_added_in_place_is_stepped():
    ref, mine = _model(), _model()
    o_ref = torch.optim.AdamW(list(ref[0].parameters()), lr=1e-2, fused=True)
    o_mine = torch.optim.AdamW(list(mine[0].parameters()), lr=1e-2, fused=True)

    def grow(i, opt, m):
        if i == 3:  # the same param_groups list, one group longer
            opt.add_param_group({"params": [m[3].weight], "lr": 3e-3})
        if i == 6:  # the same params list, one parameter longer
            opt.param_groups[1]["params"].append(m[3].bias)
    batches = _batches()
    _train(ref, o_ref, batches, ours=False, between=lambda i: grow(i, o_ref, ref))
    _train(mine, o_mine, batches, ours=True, between=lambda i: grow(i, o_mine, mine))
    _same(ref, mine, o_ref, o_mine)
    assert lean_step_for(o_mine).steps == len(batches) - 3  # torch makes each new parameter's state


def test_the_kept_lists_do_not_keep_the_optimizer_alive():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train(model, opt, _batches(3), ours=True)
    assert lean_step_for(opt).steps == 2
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None  # a run's optimizer and its state are freed when the run lets go of them


def test_every_case_it_cannot_mirror_goes_through_optimizer_step():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    lean = lean_step_for(opt)
    batches = iter(_batches(20))
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))

    def one():
        x, y = next(batches)
        F.cross_entropy(model(x), y).backward()
        optimizer_step(opt)
        zero_grad(opt)
    one()
    one()  # a hook: torch steps
    assert len(calls) == 2 and lean.steps == 0
    opt._optimizer_step_post_hooks.clear()
    one()
    assert lean.steps == 1 and len(calls) == 2
    opt.found_inf = torch.zeros(())  # the guard's device skip: torch reads it
    one()
    del opt.found_inf
    assert lean.steps == 1
    for g in opt.param_groups:  # the kernel switched to foreach: the lists are rebuilt for torch's foreach ops
        g["fused"], g["foreach"] = False, True
    one()
    assert lean.steps == 2
    for g in opt.param_groups:
        g["fused"], g["foreach"] = True, False
    one()
    assert lean.steps == 3
    for g in opt.param_groups:  # a tensor LR off the fused path: torch's foreach path refuses it, its for-loop runs
        g["fused"], g["foreach"], g["lr"] = None, False, torch.tensor(1e-2)
    one()
    assert lean.steps == 3
    for g in opt.param_groups:
        g["fused"], g["lr"] = True, 1e-2
    model[3].bias.requires_grad_(False)  # a parameter without a gradient this step
    one()
    assert lean.steps == 3
    cleared = []
    opt.zero_grad = lambda set_to_none=True: cleared.append(set_to_none)  # replaced on the instance: it runs
    zero_grad(opt)
    assert cleared == [True]
    assert lean_step_for(torch.optim.RMSprop(model.parameters(), lr=0.1)) is None


class _Sub(torch.Tensor):
    """A tensor subclass (as FSDP2's DTensor shards are): torch's own step groups and dispatches it."""


def test_a_tensor_subclass_parameter_goes_through_torchs_step():
    ref, mine = _model(), _model()
    for m in (ref, mine):
        m[3].weight = nn.Parameter(m[3].weight.detach().as_subclass(_Sub))
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    o_mine = torch.optim.AdamW(mine.parameters(), lr=1e-2, fused=True)
    batches = _batches(5)
    _train(ref, o_ref, batches, ours=False)
    _train(mine, o_mine, batches, ours=True)
    _same(ref, mine, o_ref, o_mine)
    assert lean_step_for(o_mine).steps == 0


def test_fit_steps_a_fused_adamw_through_the_lean_step(adamw_step_calls):
    """On the CPU `fit`'s fused AdamW goes through torch's `step` for the first update only (this fails with the
    lean step switched off: every update is torch's)."""
    calls = adamw_step_calls
    torch.manual_seed(0)
    x, y = torch.randn(200, 6), torch.randint(0, 2, (200,))
    res = torchspeed.fit(nn.Linear(6, 2), DataLoader(TensorDataset(x, y), batch_size=20), epochs=2,
                         optimizer="adamw", lr=1e-2, fused_optimizer=True, precision="fp32", trial=False,
                         progress=False)
    assert res.steps == 20
    assert len(calls) == 1


# ------------------------------------------------------------------ the moments in flat buffers (flat_state)
from torchspeed.train.state import flat_state  # noqa: E402


def _shares_one_buffer(opt, key):
    tensors = [opt.state[p][key] for g in opt.param_groups for p in g["params"]]
    return len({t.untyped_storage().data_ptr() for t in tensors}) == 1


@pytest.mark.parametrize("kind,kw,key", [
    (torch.optim.Adam, dict(lr=1e-2), "exp_avg"),
    (torch.optim.Adam, dict(lr=3e-3, weight_decay=1e-3, maximize=True), "exp_avg_sq"),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05, betas=(0.8, 0.95), eps=1e-6), "exp_avg"),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4), "momentum_buffer"),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, maximize=True), "momentum_buffer"),
])
def test_flat_moments_give_the_for_loops_numbers_bit_for_bit(kind, kw, key):
    """A group of small tensors keeps its moments in one buffer and runs each kernel once over it; the numbers are
    the for-loop's exactly (this CPU's kernels agree at every position; where they do not, the flat path is off)."""
    if not flat_state.kernels_agree():
        pytest.skip("this CPU's elementwise kernels differ between a tensor's body and its tail: no flat buffers")
    ref, mine = _model(), _model()
    o_ref, o_mine = kind(ref.parameters(), foreach=False, **kw), kind(mine.parameters(), **kw)
    batches = _batches()
    _train(ref, o_ref, batches, ours=False)
    _train(mine, o_mine, batches, ours=True)
    _same(ref, mine, o_ref, o_mine)
    lean = lean_step_for(o_mine)
    assert lean.flat_steps == lean.steps == len(batches) - 1
    assert _shares_one_buffer(o_mine, key) and not _shares_one_buffer(o_ref, key)
    assert all(o_mine.state[p][key].shape == p.shape for p in mine.parameters())  # the state reads as torch's


def test_flat_moments_are_off_where_the_kernels_disagree_or_the_tensors_are_large(monkeypatch):
    """The rule: flat only where this CPU's kernels agree by position and the tensors are small on average."""
    def run(**patch):
        for k, v in patch.items():
            monkeypatch.setattr(flat_state, k, v)
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        _train(model, opt, _batches(4), ours=True)
        return lean_step_for(opt), opt
    lean, opt = run(kernels_agree=lambda: False)
    assert lean.steps == 3 and lean.flat_steps == 0 and not _shares_one_buffer(opt, "exp_avg")
    lean, opt = run(kernels_agree=lambda: True, MEAN_NUMEL=8)  # the model's tensors: 29 numbers on average
    assert lean.steps == 3 and lean.flat_steps == 0
    lean, opt = run(kernels_agree=lambda: True, MEAN_NUMEL=32, MAX_NUMEL=114)  # 4 tensors, 115 numbers in all
    assert lean.steps == 3 and lean.flat_steps == 0
    lean, opt = run(kernels_agree=lambda: True, MEAN_NUMEL=32, MAX_NUMEL=115)
    assert lean.steps == 3 and lean.flat_steps == 3 and _shares_one_buffer(opt, "exp_avg")


def test_the_kernel_check_finds_an_op_that_differs_in_a_tensors_tail():
    """`kernels_agree`'s check, on an op that gives other numbers in pieces too short for a vector body."""
    g = torch.Generator().manual_seed(0)
    assert flat_state._agree(lambda a, b, c: a.mul_(0.999).addcmul_(b, b, value=0.001), g)
    assert not flat_state._agree(lambda a, b, c: a.add_(1.0 if a.numel() > 64 else 1.0 + 1e-3), g)


def _resume_and_freeze(opt, model):
    """`_train`'s `between`: the optimizer's state saved after step 3 and loaded back after step 6 (a resume), and
    step 9 taken with the last layer's bias frozen (torch steps only the others)."""
    saved = {}

    def between(i):
        if i == 3:
            saved["state"] = copy.deepcopy(opt.state_dict())
        if i == 6:
            opt.load_state_dict(saved["state"])
        if i == 8:
            model[3].bias.requires_grad_(False)
        if i == 9:
            model[3].bias.requires_grad_(True)
    return between


def test_flat_moments_follow_a_state_loaded_midway_and_a_step_torch_took(monkeypatch):
    """A resume replaces the state: new buffers hold the loaded numbers. A step torch took for the parameters that
    had gradients leaves the counts unequal: that group steps per tensor. The numbers stay the for-loop's."""
    exact = flat_state.kernels_agree()
    monkeypatch.setattr(flat_state, "kernels_agree", lambda: True)  # the path under test on any CPU ...
    ref, mine = _model(), _model()
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    o_mine = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    batches = _batches(14)
    _train(ref, o_ref, batches, ours=False, between=_resume_and_freeze(o_ref, ref))
    _train(mine, o_mine, batches, ours=True, between=_resume_and_freeze(o_mine, mine))
    lean = lean_step_for(o_mine)
    assert lean.steps == len(batches) - 2 and 0 < lean.flat_steps < lean.steps
    if exact:  # ... and the numbers checked where this CPU gives them exactly
        _same(ref, mine, o_ref, o_mine)
    counts = {o_mine.state[p]["step"].item() for p in mine.parameters()}
    assert counts == {o_ref.state[p]["step"].item() for p in ref.parameters()} and len(counts) == 2


class _WithFrozen(nn.Module):
    """A model whose optimizer is given all its parameters while some are frozen: a BYOL/EMA target network or a
    frozen backbone under `Adam(model.parameters())`. torch steps only the parameters with gradients."""

    def __init__(self):
        super().__init__()
        self.net = _model()
        self.frozen = nn.Linear(3, 3).requires_grad_(False)

    def forward(self, x):
        return self.net(x) + 0.1 * self.frozen(self.net(x).detach())


@pytest.mark.parametrize("kind,kw", [
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-3)),
    (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
])
def test_parameters_torch_never_steps_leave_the_rest_to_the_lean_step_bit_for_bit(kind, kw):
    """The frozen parameters get no state from torch; the lean step keeps the lists of the stepped ones (it had built
    none, and retried the build every step) and gives torch's numbers. Unfrozen midway, the frozen layer's first
    step is torch's (it makes its state) and the steps after it are lean again, over every parameter."""
    torch.manual_seed(0)
    ref = _WithFrozen()
    mine = copy.deepcopy(ref)
    o_ref, o_mine = kind(ref.parameters(), **kw), kind(mine.parameters(), **kw)

    def unfreeze(model):
        return lambda i: model.frozen.requires_grad_(True) if i == 5 else None
    batches = _batches()
    _train(ref, o_ref, batches, ours=False, between=unfreeze(ref))
    _train(mine, o_mine, batches, ours=True, between=unfreeze(mine))
    for pa, pb in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(pa, pb)
    lean = lean_step_for(o_mine)
    assert lean.steps == len(batches) - 2  # all but torch's first step and the unfrozen layer's first
    assert not lean._idle[0] and len(lean._groups[0][2]) == len(list(mine.parameters()))

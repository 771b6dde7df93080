"""What `UserState` puts back and casts back (train/trial/user_state.py): a step_fn's closure (a dict, a nonlocal), the
globals it writes, a callable object's attributes, a forward's attributes on the model, another model's weights,
gradients and optimizer state (a GAN's discriminator), tensors written in place; and a trained half-precision
turn's bf16 tensors cast back to the dtype the state held."""

import torch
from torch import nn
from torch.nn.utils import prune

from torchspeed.train.trial.user_state import UserState

CARRIED = None  # a global a step_fn writes (`global CARRIED`)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.seen, self.calls = nn.Linear(4, 4), [], 0

    def forward(self, x):
        self.calls += 1
        self.seen.append(x.detach())
        self.last = x.detach()
        return self.lin(x)


def test_restore_puts_back_the_closure_globals_module_attributes_and_tensors_written_in_place():
    model, memory, box = Net(), torch.zeros(3), {"hidden": torch.ones(2)}
    counter = 0

    def step_fn(m, batch):
        global CARRIED
        nonlocal counter
        counter += 1
        box["hidden"] = box["hidden"].to(torch.bfloat16) * 2
        memory.add_(1.0)  # in place
        CARRIED = m(batch).sum()
        return CARRIED

    snap = UserState(model, step_fn).snapshot()
    hidden = box["hidden"]
    step_fn(model, torch.randn(2, 4))
    assert counter == 1 and model.calls == 1 and box["hidden"] is not hidden and memory[0] == 1.0
    snap.restore()
    assert counter == 0 and model.calls == 0 and model.seen == [] and not hasattr(model, "last")
    assert box["hidden"] is hidden and torch.equal(memory, torch.zeros(3)) and "CARRIED" not in globals() or \
        CARRIED is None


def test_restore_puts_back_another_models_weights_gradients_and_optimizer_state():
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_d = torch.optim.Adam(disc.parameters(), lr=0.1)
    before = [p.detach().clone() for p in disc.parameters()]

    def step_fn(g, batch):  # a GAN's discriminator step inside the generator's step
        d_loss = disc(g(batch).detach()).mean()
        d_loss.backward()
        opt_d.step()
        return disc(g(batch)).mean()

    snap = UserState(gen, step_fn).snapshot()
    step_fn(gen, torch.randn(3, 4))
    assert not torch.equal(next(disc.parameters()), before[0]) and opt_d.state
    snap.restore()
    assert all(torch.equal(p, q) for p, q in zip(disc.parameters(), before))
    assert all(p.grad is None for p in disc.parameters()) and not opt_d.state


class Stepper:
    """A callable step_fn object that carries its hidden state on self."""

    def __init__(self):
        self.hidden = None

    def __call__(self, model, batch):
        out = model(batch)
        self.hidden = out.detach()
        return out.sum()


def test_cast_back_returns_a_trained_half_turns_state_to_the_dtype_it_held():
    model, stepper = Net(), Stepper()
    state = {"h": (torch.zeros(2), torch.zeros(2)), "keep": torch.zeros(2, dtype=torch.bfloat16)}

    def step_fn(m, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = stepper(m, batch)
            state["h"] = tuple(h.to(torch.bfloat16) + 1 for h in state["h"])
        return loss

    snap = UserState(model, step_fn).snapshot()
    step_fn(model, torch.randn(2, 4))
    assert stepper.hidden.dtype == torch.bfloat16 and state["h"][0].dtype == torch.bfloat16
    assert snap.cast_back() == 3  # the two in the closure's dict, and the callable object's it reaches
    assert state["h"][0].dtype == torch.float32 and torch.equal(state["h"][0], torch.ones(2))
    assert stepper.hidden.dtype == torch.float32
    assert state["keep"].dtype == torch.bfloat16  # bf16 before the turn: the user's own, left alone


def test_restore_puts_back_the_models_own_weights_an_inner_optimizer_stepped():
    """A GAN in one module: the step_fn steps the discriminator (a part of the trained model) with its own
    optimizer. A measuring pass moved those weights; they are put back, with the optimizer's moments."""
    model = nn.ModuleDict({"G": nn.Linear(4, 4), "D": nn.Linear(4, 1)})
    opt_d = torch.optim.Adam(model["D"].parameters(), lr=0.1)
    before = [p.detach().clone() for p in model["D"].parameters()]

    def step_fn(m, batch):
        opt_d.zero_grad()
        m["D"](m["G"](batch).detach()).mean().backward()
        opt_d.step()
        return m["D"](m["G"](batch)).mean()

    snap = UserState(model, step_fn).snapshot()
    step_fn(model, torch.randn(3, 4))
    snap.restore()
    assert all(torch.equal(p, q) for p, q in zip(model["D"].parameters(), before)) and not opt_d.state


def test_restore_puts_back_the_models_frozen_parameters_a_step_moved_in_place():
    """BYOL's momentum target: parameters that need no gradient, moved towards the online ones by the step itself
    (in place, or by rebinding `.data` as MoCo's code does), put back after a pass that only measures."""
    online, target = nn.Linear(4, 4), nn.Linear(4, 4).requires_grad_(False)
    model = nn.ModuleDict({"online": online, "target": target})
    before = [p.detach().clone() for p in target.parameters()]

    def step_fn(m, batch):
        with torch.no_grad():
            m["target"].weight.mul_(0.5).add_(m["online"].weight, alpha=0.5)
        m["target"].bias.data = m["target"].bias.data * 0.5 + 1.0
        return m["online"](batch).sum()

    snap = UserState(model, step_fn).snapshot()
    step_fn(model, torch.randn(2, 4))
    assert not torch.equal(target.weight, before[0]) and not torch.equal(target.bias, before[1])
    snap.restore()
    assert all(torch.equal(p, b) for p, b in zip(target.parameters(), before)) and not snap.unrestored


def test_a_frozen_part_does_not_take_the_copies_a_carried_state_needs(monkeypatch):
    """The copies are bounded (CLONE_BYTES): the step's own state is walked before the frozen parameters, so a
    frozen backbone that would fill the bound cannot push the small carried state out of it (watched, not undone)."""
    import torchspeed.train.trial.user_state as us

    model = nn.ModuleDict({"backbone": nn.Linear(64, 64).requires_grad_(False), "head": nn.Linear(64, 2)})
    monkeypatch.setattr(us, "CLONE_BYTES", sum(p.numel() * 4 for p in model["backbone"].parameters()))
    box = {"hidden": torch.zeros(4)}
    weight = model["backbone"].weight.detach().clone()

    def step_fn(m, batch):
        box["hidden"].add_(1.0)
        with torch.no_grad():
            m["backbone"].weight.mul_(0.5)
        return m["head"](m["backbone"](batch)).sum()

    snap = UserState(model, step_fn).snapshot()
    step_fn(model, torch.randn(2, 64))
    snap.restore()
    assert torch.equal(box["hidden"], torch.zeros(4)) and torch.equal(model["backbone"].weight, weight)


def test_restore_puts_back_what_a_users_code_set_on_a_torch_module_and_leaves_torchs_own():
    model = nn.Sequential(nn.Linear(4, 4))
    model.seen, model.memory = 3, torch.zeros(2)

    def step_fn(m, batch):
        m.seen += 1
        m.memory.add_(1.0)
        object.__setattr__(m, "ema", nn.Linear(4, 4))  # a plain attribute, not a submodule
        return m(batch).sum()

    snap = UserState(model, step_fn).snapshot()
    step_fn(model, torch.randn(2, 4))
    model[0]._private_cache = 1  # torch's own bookkeeping names are not the user's
    snap.restore()
    assert model.seen == 3 and torch.equal(model.memory, torch.zeros(2)) and "ema" not in vars(model)
    assert model[0]._private_cache == 1


def test_restore_puts_back_what_the_users_hooks_keep_and_leaves_torchs_own():
    """A forward hook that keeps activations in a list, a gradient hook that sums a Fisher information, a backward
    hook with a default-argument list: a pass that only measures ran each once more. torch's own hooks (pruning's
    forward pre-hook) are not the user's: not walked."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    acts, fisher = [], {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    model[1].register_forward_hook(lambda m, i, o: acts.append(o.detach()))
    for n, p in model.named_parameters():
        p.register_hook(lambda g, n=n: fisher[n].add_(g.detach() ** 2))

    def log_norm(m, gin, gout, norms=[]):  # noqa: B006 (a script's own cache)
        norms.append(float(gout[0].norm()))
    model[2].register_full_backward_hook(log_norm)
    prune.l1_unstructured(model[0], "weight", amount=0.25)  # torch's forward pre-hook
    x = torch.randn(5, 4)
    model(x).sum().backward()
    before = ([a.clone() for a in acts], {n: t.clone() for n, t in fisher.items()}, list(log_norm.__defaults__[0]))
    snap = UserState(model).snapshot()
    model(x).sum().backward()  # a pass that only measures
    assert len(acts) == 2 and len(log_norm.__defaults__[0]) == 2
    snap.restore()
    assert len(acts) == 1 and torch.equal(acts[0], before[0][0]) and log_norm.__defaults__[0] == before[2]
    assert all(torch.equal(fisher[n], before[1][n]) for n in fisher)
    assert model[0]._forward_pre_hooks  # pruning's hook is torch's: still there, untouched

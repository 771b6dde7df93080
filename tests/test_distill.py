"""fit(student, loader, teacher=...) (T38): the KD loss is the hand-written one, the teacher gets no gradients and
teaches (a student on random labels learns the teacher's function), the cache runs the teacher once per sample,
and a teacher with another number of classes is a clear error. No assertion reads a clock."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.distill import Teacher, kd_loss, prepare_distillation

N, D, C = 192, 8, 4


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    y = torch.randint(0, C, (N,), generator=g)  # random labels: only a teacher can teach a function
    return x, y


def _teacher(classes=C):
    torch.manual_seed(1)
    t = nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Linear(32, classes))
    with torch.no_grad():
        t[2].weight.mul_(4.0)  # confident outputs
    return t


def _student():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Linear(32, C))


def _fit(student, loader, **kw):
    return torchspeed.fit(student, loader, device="cpu", progress=False, optimizer="adamw", lr=1e-2,
                          precision="fp32", channels_last=False, compile=False, trial=False, **kw)


@pytest.mark.parametrize("alpha", [0.0, 0.7, 1.0])
def test_kd_loss_equals_the_hand_written_one(alpha):
    torch.manual_seed(0)
    s, t, y, temp = torch.randn(16, 10), torch.randn(16, 10), torch.randint(0, 10, (16,)), 3.0
    hand = alpha * F.kl_div(F.log_softmax(s / temp, 1), F.softmax(t / temp, 1), reduction="batchmean") * temp ** 2 \
        + (1 - alpha) * F.cross_entropy(s, y)
    torch.testing.assert_close(kd_loss(s, t, y, temperature=temp, alpha=alpha), hand)
    # the cached form with every class (top 10 of 10) is the same loss
    v, i = t.topk(10, dim=-1)
    torch.testing.assert_close(kd_loss(s, v, y, temperature=temp, alpha=alpha, teacher_index=i), hand)


def test_kd_loss_on_the_top_k_renormalises_the_teachers_k_classes():
    torch.manual_seed(0)
    s, t, temp = torch.randn(8, 10), torch.randn(8, 10), 2.0
    v, i = t.topk(3, dim=-1)
    p_t = F.softmax(v / temp, 1)
    hand = (p_t * (p_t.log() - F.log_softmax(s / temp, 1).gather(1, i))).sum(1).mean() * temp ** 2
    torch.testing.assert_close(kd_loss(s, v, torch.zeros(8, dtype=torch.long), temperature=temp, alpha=1.0,
                                       teacher_index=i), hand)


def test_the_teacher_teaches_and_gets_no_gradients():
    x, y = _data()
    teacher = _teacher()
    before = [p.detach().clone() for p in teacher.parameters()]
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    student = _student()
    r = _fit(student, loader, epochs=15, teacher=Teacher(teacher, alpha=1.0, temperature=1.0, cache=False))
    assert all(p.grad is None for p in teacher.parameters()) and not teacher.training
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.parameters()))
    assert r.decisions["distill"].value is False
    plain = _student()
    _fit(plain, loader, epochs=15)
    with torch.no_grad():
        agree = (student.eval()(x).argmax(1) == teacher(x).argmax(1)).float().mean().item()
        chance = (plain.eval()(x).argmax(1) == teacher(x).argmax(1)).float().mean().item()
    assert agree > 0.85 and agree > chance + 0.3, (agree, chance)


class _Counter:
    def __init__(self, model):
        self.samples = 0
        model.register_forward_hook(self)

    def __call__(self, module, args, out):
        self.samples += args[0].shape[0]


@pytest.mark.parametrize("cache", [True, False])
def test_with_the_cache_the_teacher_runs_once_per_sample(cache):
    x, y = _data()
    teacher = _teacher()
    count = _Counter(teacher)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    r = _fit(_student(), loader, epochs=3, val_loader=loader, teacher=Teacher(teacher, cache=cache, topk=3))
    checked = 2  # the class check's forward of two samples
    assert count.samples - checked == (N if cache else 3 * N), count.samples
    d = r.decisions["distill"]
    assert d.value is cache and (not cache or d.measured["topk"] == 3)
    assert r.final["val_acc"] is not None and r.final["val_loss"] > 0  # validation: the task loss, the labels


def test_auto_cache_measures_both_costs_on_a_run_of_about_one_pass():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    kd = prepare_distillation(_teacher(), _student(), loader, epochs=1, device="cpu")
    assert set(kd.decision.measured) >= {"teacher_batch_s", "cache_total_s", "per_step_total_s", "steps"}
    assert kd.decision.measured["steps"] == len(loader)
    batch = next(iter(kd.loader))
    assert len(batch) == (4 if kd.decision.value else 2)


def test_a_run_of_two_passes_or_more_caches_by_count_without_timing(monkeypatch):
    """Its steps would run the teacher on every sample twice or more: the cache pass (once each) is cheaper without
    a measurement, which costs about 4 teacher forwards of a chunk."""
    import torchspeed.distill as distill

    def timed(*a, **k):
        raise AssertionError("the teacher was timed")
    monkeypatch.setattr(distill, "_decide_cache", timed)
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    kd = prepare_distillation(_teacher(), _student(), loader, epochs=2, device="cpu")
    passes = 2 * len(loader) * 32 / len(x)
    assert kd.decision.value is True and kd.decision.measured["passes"] == pytest.approx(passes, abs=0.01)
    assert "counted" in kd.decision.reason and len(next(iter(kd.loader))) == 4
    with pytest.raises(AssertionError, match="timed"):  # a run of less than 2 passes is measured
        prepare_distillation(_teacher(), _student(), loader, epochs=1, device="cpu")


def test_a_teacher_with_another_number_of_classes_names_the_fix():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    with pytest.raises(ValueError, match=r"teacher outputs 10 classes and the student 4: distil from a teacher "
                                         r"trained on the same labels"):
        _fit(_student(), loader, teacher=_teacher(classes=10))
    with pytest.raises(ValueError, match="leave step_fn out"):
        _fit(_student(), loader, teacher=_teacher(), step_fn=lambda m, b: m(b[0]).sum())
    with pytest.raises(ValueError, match="temperature"):
        Teacher(_teacher(), temperature=0)

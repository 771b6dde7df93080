"""BatchedMuon: torch's Muon with the Newton-Schulz iterations batched (train/muon_batched.py)."""

import pytest
import torch

from torchspeed.train.muon_batched import BatchedMuon, _buckets, batched_newton_schulz
from torch.optim._muon import _zeropower_via_newtonschulz

COEF = (3.4445, -4.7750, 2.0315)
SHAPES = [(64, 64), (64, 64), (256, 64), (64, 256), (32, 96), (96, 32), (64, 64)]


def _mats(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in SHAPES]


@pytest.mark.parametrize("pad", ["all", "shape", "auto"])
def test_batched_newton_schulz_equals_torch_per_matrix(pad):
    mats = _mats()
    got = batched_newton_schulz(mats, COEF, 5, 1e-7, pad=pad)
    for m, o in zip(mats, got):
        want = _zeropower_via_newtonschulz(m, COEF, 5, 1e-7)
        assert o.shape == m.shape and o.dtype == torch.bfloat16
        # bf16 products summed in another order: a few bf16 ulps, far below the update's scale
        torch.testing.assert_close(o.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert (o.float() - want.float()).abs().mean() < 3e-3


def test_buckets_pad_all_is_one_tensor_and_shape_is_one_per_shape():
    shapes = [torch.Size(s) for s in SHAPES]
    assert len(_buckets(shapes, "all")) == 1
    assert _buckets(shapes, "all")[0][0] == (64, 256)  # the largest oriented rows and cols (96x32 lies as 32x96)
    assert sorted(len(ix) for _, ix in _buckets(shapes, "shape")) == [2, 2, 3]  # 64x64 x3, 64x256 x2, 32x96 x2
    # auto: padding a 32x96 and a 64x64 up to 64x256 is over 1.5x the exact work here: by shape
    assert len(_buckets(shapes, "auto")) == 3
    same = [torch.Size((64, 64))] * 3 + [torch.Size((64, 80))]
    assert len(_buckets(same, "auto")) == 1  # near shapes: one padded tensor
    wide = [torch.Size((384, 384))] * 3 + [torch.Size((384, 400))]
    assert len(_buckets(wide, "auto")) == 2  # large ones are compute-bound: padding adds real work, by shape


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 64, bias=False),
                               torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 10, bias=False))


@pytest.mark.parametrize("pad", ["all", "shape"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_muon_steps_like_torch_muon(pad, nesterov):
    a, b = _model(), _model()
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
    ref = torch.optim.Muon(a.parameters(), **kw)
    opt = BatchedMuon(b.parameters(), pad=pad, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        for m, o in ((a, ref), (b, opt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(opt.state[pb]["momentum_buffer"], ref.state[pa]["momentum_buffer"],
                                   atol=2e-3, rtol=2e-3)


def test_batched_muon_moves_weights_as_muon_does_not_as_sgd():
    """The update is orthogonalized: every singular value of one step's change near lr x the shape's factor,
    not the gradient's spread (a step that skipped Newton-Schulz would fail this)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64, bias=False)
    before = m.weight.detach().clone()
    opt = BatchedMuon(m.parameters(), lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False)
    u, _, v = torch.linalg.svd(torch.randn(64, 64))
    m.weight.grad = u @ torch.diag(torch.logspace(-1.5, 0, 64)) @ v.T  # singular values 0.03 to 1
    opt.step()
    s = torch.linalg.svdvals(before - m.weight.detach()) / 0.1
    assert s.min() > 0.5 and s.max() < 1.5


def test_state_dict_loads_across_torch_muon_and_batched():
    a, b = _model(), _model()
    ref = torch.optim.Muon(a.parameters(), lr=0.02)
    for p in a.parameters():
        p.grad = torch.ones_like(p)
    ref.step()
    opt = BatchedMuon(b.parameters(), lr=0.02)
    opt.load_state_dict(ref.state_dict())
    assert all("momentum_buffer" in opt.state[p] for p in b.parameters())


def test_no_matrices_is_no_work():
    assert batched_newton_schulz([], COEF, 5, 1e-7) == []


def test_bad_pad_is_a_clear_error():
    with pytest.raises(ValueError, match="pad must be one of"):
        BatchedMuon(_model().parameters(), pad="diagonal")

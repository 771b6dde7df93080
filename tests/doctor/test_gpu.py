"""On CUDA: host syncs, unpinned copies and cudnn.benchmark are found (a host sync ranked by what it
was timed to cost: on an H200 one `.item()` a step on this small model costs under 2%), and --verify
measures pin_memory and autocast on the GPU."""

import textwrap

import pytest

from torchspeed.doctor import DoctorJob, diagnose_many
from torchspeed.doctor.registry import severity_for_gain

SCRIPT = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

dev = torch.device("cuda")
ds = TensorDataset(torch.randn(4096, 3, 32, 32), torch.randint(0, 10, (4096,)))
model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                      nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(64, 10)).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(10):
    for x, y in DataLoader(ds, batch_size=128, shuffle=True):
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(loss.item())
'''


@pytest.mark.gpu
def test_cuda_script_findings_and_verify(tmp_path):
    p = tmp_path / "cuda_train.py"
    p.write_text(textwrap.dedent(SCRIPT))
    job = DoctorJob(script=str(p), steps=10, warmup=3, verify=True, rounds=3,
                    fixes=("autocast", "channels_last", "pin_memory"), time_limit=300)
    r = diagnose_many([job], quiet=True)[0]
    assert r.status == "stopped", (r.traceback, r.notes)
    found = {f.rule: f for f in r.findings}
    sync = found["host-sync"]  # print(loss.item()) every step: found, timed, ranked by what it costs
    assert sync.basis == "timed" and ".item()" in sync.evidence, sync
    assert sync.severity == severity_for_gain(min(sync.est_gain, (sync.interval or (sync.est_gain,))[0])), sync
    assert "pin-memory" in found and "cudnn-benchmark" in found and "conv-bias-before-bn" in found
    assert r.breakdown["copy_ms"] > 0
    assert {"autocast", "channels_last", "pin_memory"} <= set(r.verify), r.verify
    for v in r.verify.values():
        assert "error" not in v, v

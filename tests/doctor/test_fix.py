"""--fix: patches written with libcst keep the script's comments, apply, and the patched script still trains;
each patch is measured on the script itself, slower ones are left out, and only --apply writes the file."""

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchspeed.cli.main import main
from torchspeed.doctor import diagnose
from torchspeed.doctor import fix as fix_mod
from torchspeed.doctor import _patches  # noqa: F401  (registers every patch)
from torchspeed.doctor._patch_base import PATCHES, NotApplicable, PatchContext, apply_patch
from torchspeed.doctor.fix import fix_script, plan_patches

# A script in the style of a tutorial: a TensorDataset through a DataLoader, zero_grad(set_to_none=False),
# fp32 forward; it prints its loss every epoch so the test can see that it still trains once patched.
SCRIPT = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
X = torch.randn(1024, 16)
Y = (X[:, :4].sum(1) > 0).long()  # a learnable target
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))  # the model
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(X, Y), batch_size=64, shuffle=True)
for epoch in range(6):
    total = 0.0
    for xb, yb in loader:
        opt.zero_grad(set_to_none=False)  # zeros every gradient
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        total += loss.item()
    print(f"epoch {epoch} loss {total / len(loader):.4f}", flush=True)
'''


def _losses(source: str, tmp_path: Path) -> list[float]:
    f = tmp_path / "patched_run.py"
    f.write_text(source)
    out = subprocess.run([sys.executable, str(f)], capture_output=True, text=True, timeout=300, check=True).stdout
    return [float(line.split()[-1]) for line in out.splitlines() if line.startswith("epoch")]


def test_each_patch_keeps_comments_and_writes_the_change():
    src = textwrap.dedent(SCRIPT)
    ctx = PatchContext(device="cpu", workers=2, threads=1)
    out = apply_patch("set_to_none", src, ctx)
    assert "        opt.zero_grad()  # zeros every gradient\n" in out
    out = apply_patch("batched_index", src, ctx)
    assert ("loader = (lambda _ds: DataLoader(_ds, batch_size=None, sampler=torch.utils.data."
            "BatchSampler(torch.utils.data.RandomSampler(_ds), 64, drop_last=False)))(TensorDataset(X, Y))") in out
    out = apply_patch("autocast", src, ctx)
    assert ('        with torch.autocast("cpu", dtype=torch.bfloat16):\n'
            "            loss = nn.functional.cross_entropy(model(xb), yb)\n") in out
    out = apply_patch("compile", src, ctx)
    assert "# the model\nmodel = torch.compile(model)\n" in out
    out = apply_patch("workers", src, ctx)
    assert "DataLoader(TensorDataset(X, Y), batch_size=64, shuffle=True, num_workers=2, persistent_workers=True)" in out
    out = apply_patch("threads", src, ctx)
    assert "from torch.utils.data import DataLoader, TensorDataset\ntorch.set_num_threads(1)" in out
    out = apply_patch("bf16_math", src, ctx)
    assert 'torch.backends.mkldnn.matmul.fp32_precision = "bf16"' in out
    out = apply_patch("channels_last", src, ctx)
    assert "model(xb.contiguous(memory_format=torch.channels_last))" in out
    debug = "torch.autograd.set_detect_anomaly(True)  # debugging a NaN\n" + src
    assert apply_patch("debug_off", debug, ctx).startswith("torch.autograd.set_detect_anomaly(False)  # debugging")
    for name in PATCHES:  # every patch leaves valid Python and every comment in place
        try:
            out = apply_patch(name, src, ctx)
        except NotApplicable:
            continue
        compile(out, "x.py", "exec")
        assert all(c in out for c in ("# a learnable target", "# the model", "# zeros every gradient"))
    with pytest.raises(NotApplicable):
        apply_patch("set_to_none", src.replace("set_to_none=False", ""), ctx)


def test_patched_script_still_trains(tmp_path):
    src = textwrap.dedent(SCRIPT)
    patched = src
    for name in ("set_to_none", "batched_index", "autocast"):
        patched = apply_patch(name, patched, PatchContext())
    assert patched.count("\n") >= src.count("\n")
    before, after = _losses(src, tmp_path), _losses(patched, tmp_path)
    assert len(after) == 6 and after[-1] < after[0] * 0.8  # the patched script learns as the original does
    assert before[-1] < before[0] * 0.8


def _digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user")
    script = folder / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    return script, diagnose(str(script), steps=4, warmup=2, quiet=True)


def test_fix_measures_each_patch_and_keeps_only_faster_ones(diagnosed, monkeypatch):
    import dataclasses

    from torchspeed.doctor.report import Finding

    script, report = diagnosed
    assert "zero-grad-memset" in report.rules
    # a second patch whatever this machine's timing made the rules find (an injected finding)
    report = dataclasses.replace(report, findings=report.findings + (
        Finding("elementwise-bound", "low", "injected", "compile", est_gain=1.2, patch="compile"),))
    calls = []

    def fake_measure(path, args, sources, **kw):  # injected: patch 1 faster, patch 2 slower, ...
        calls.append(sources)
        speed = [1.0] + [(1.3, 0.8)[(i - 1) % 2] for i in range(1, len(sources))]
        return [{"ratios": [s], "ms": [10.0], "error": None, "speedup": s} for s in speed]

    monkeypatch.setattr(fix_mod, "_measure", fake_measure)
    before = _digest(script.parent)
    res = fix_script(report, steps=4, warmup=2, rounds=1)
    assert calls[0][0] is None and len(calls) == 2 and calls[1][0] is None  # original first, then the combination
    ps = res["patches"]
    assert len(ps) >= 2, ps
    assert [p["kept"] for p in ps] == [p["speedup"] > 1.0 for p in ps] and not all(p["kept"] for p in ps)
    for p in ps:
        assert p["diff"].startswith("--- a/train.py\n+++ b/train.py\n") and p["rule"] and p["speedup"] > 0
    assert res["end_to_end_speedup"] == 1.3 and res["combined_diff"] and not res["applied"]
    assert _digest(script.parent) == before  # without --apply nothing is written
    res = fix_script(report, steps=4, warmup=2, rounds=1, apply=True)
    assert res["applied"] and script.read_text() != textwrap.dedent(SCRIPT)
    assert set(_digest(script.parent)) == set(before)  # the file changed, nothing was added
    script.write_text(textwrap.dedent(SCRIPT))


def test_cli_fix_json_measures_on_the_script_itself(diagnosed, tmp_path):
    script, _ = diagnosed
    before = _digest(script.parent)
    out = tmp_path / "fix.json"
    rc = main(["doctor", str(script), "--steps", "3", "--warmup", "2", "--fix", "--fix-rounds", "1",
               "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())["fix"]
    assert d["patches"] and "end_to_end_speedup" in d
    for p in d["patches"]:
        assert {"rule", "diff", "speedup"} <= set(p) and "error" not in p, p
        assert isinstance(p["speedup"], float) and p["diff"].startswith("--- a/train.py")
    assert _digest(script.parent) == before


def test_fix_usage_errors(capsys):
    script = str(Path(__file__).parent / "scripts" / "crashes.py")
    assert main(["doctor", script, "--apply"]) == 2
    assert "--fix --apply" in capsys.readouterr().err


def test_fix_without_libcst_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "libcst", None)  # `import libcst` now raises ImportError
    script = str(Path(__file__).parent / "scripts" / "crashes.py")
    assert main(["doctor", script, "--fix"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install" in err and "libcst" in err and len(err.splitlines()) == 1


def test_fix_measurements_rank_the_findings_they_prove():
    import dataclasses

    from torchspeed.doctor.registry import settle
    from torchspeed.doctor.report import DoctorReport, Finding

    est = settle(Finding("no-amp", "high", "fp32 forward", "autocast", est_gain=1.4, patch="autocast"))
    bf16 = settle(Finding("cpu-bf16-math", "high", "fp32 matmuls", "bf16 math", est_gain=1.3, patch="bf16_math"))
    other = settle(Finding("zero-grad-memset", "high", "memset", "zero_grad()", est_gain=1.01, basis="timed",
                           patch="set_to_none"))
    est = dataclasses.replace(est, also=(bf16,))
    assert est.severity == "low" and "estimated, not measured" in est.evidence
    report = DoctorReport(script="t.py", status="stopped", traceback=None, env={}, breakdown={},
                          findings=(est, other))
    # injected --fix measurements: autocast 1.02x (noise), bf16_math 1.5x on the script itself
    fix = {"patches": [{"rule": "no-amp", "patch": "autocast", "speedup": 1.02, "ratios": [0.98, 1.02, 1.06]},
                       {"rule": "cpu-bf16-math", "patch": "bf16_math", "speedup": 1.5, "ratios": [1.45, 1.5, 1.55]},
                       {"rule": "zero-grad-memset", "patch": "set_to_none", "speedup": None, "ratios": []}]}
    from torchspeed.doctor.registry import with_fix

    fixed = with_fix(report, fix)
    top = fixed.findings[0]
    assert top.rule == "cpu-bf16-math" and top.severity == "high" and top.basis == "measured"
    assert top.measured_gain == 1.5 and "--fix measured the bf16_math patch" in top.evidence
    assert "estimated, not measured" not in top.evidence
    assert [a.rule for a in top.also] == ["no-amp"] and top.also[0].severity == "low"  # 0.98-1.06x: noise
    assert fixed.finding("zero-grad-memset").basis == "timed"  # its patch was not measured
    assert fixed.rules == {"no-amp", "cpu-bf16-math", "zero-grad-memset"}


SCRIPTS = Path(__file__).parent / "scripts"


def test_autocast_patch_retargets_the_forms_real_scripts_have():
    ctx = PatchContext(device="cpu")
    want = 'torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=True)'
    forms = ["with torch.cuda.amp.autocast(enabled=scaler is not None):",
             'with torch.amp.autocast("cuda", dtype=torch.float16, enabled=args.amp):',
             "with torch.autocast(device_type=args.device, enabled=use_amp):",
             "with autocast():"]
    for form in forms:
        src = ("import torch\nmodel = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
               f"for x in data:\n    {form}  # mixed precision\n        loss = model(x).sum()\n    loss.backward()\n")
        out = apply_patch("autocast", src, ctx)
        assert f"    with {want}:  # mixed precision\n        loss = model(x).sum()\n" in out, (form, out)
    # a context chosen by device (no-op on a CPU) becomes autocast on the device the doctor saw
    nano = ("import torch\nfrom contextlib import nullcontext\n"
            "ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=pt)\n")
    assert f"ctx = {want}\n" in apply_patch("autocast", nano, ctx)
    with pytest.raises(NotApplicable, match="no autocast block"):
        apply_patch("autocast", "import torch\nx = 1\n", ctx)


def test_fix_writes_the_autocast_patch_for_a_flag_gated_cuda_block_and_it_runs(monkeypatch):
    # the reference-script form: the forward already inside torch.cuda.amp.autocast(enabled=flag)
    import copy

    from torchspeed.doctor import DoctorJob, diagnose_many, report_from_observation

    script = SCRIPTS / "amp_flag_reference.py"
    report = diagnose(str(script), args=["--epochs", "3"], steps=3, warmup=1, quiet=True)
    assert report.status == "stopped", report.traceback
    obs = copy.deepcopy(report.observation)
    obs["env"]["bf16_supported"] = True  # injected: a CPU with native bf16 (AVX512-BF16/AMX)
    report = report_from_observation(obs, script=str(script))
    assert "no-amp" in report.rules

    def fake_measure(path, args, sources, **kw):  # injected: the patch measures 1.5x on the script
        return [{"ratios": [1.0 if s is None else 1.5], "ms": [10.0], "error": None,
                 "speedup": 1.0 if s is None else 1.5} for s in sources]

    monkeypatch.setattr(fix_mod, "_measure", fake_measure)
    res = fix_script(report, args=["--epochs", "3"], steps=3, warmup=1, rounds=1)
    amp = next(p for p in res["patches"] if p["patch"] == "autocast")
    assert amp["kept"] and not [s for s in res["skipped"] if s["patch"] == "autocast"]
    assert "-        with torch.cuda.amp.autocast(enabled=scaler is not None):" in amp["diff"]
    assert '+        with torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=True):' in amp["diff"]
    assert res["end_to_end_speedup"] == 1.5
    # the report now ranks the finding by that measurement
    from torchspeed.doctor.registry import with_fix

    fixed = with_fix(report, res)
    f = next(g for g in fixed.findings if g.patch == "autocast")
    assert f.basis == "measured" and f.measured_gain == 1.5
    # the patched script runs, and its forward now autocasts on the CPU
    source = next(c["source"] for c in plan_patches(report, script.read_text())[0] if c["patch"] == "autocast")
    run = diagnose_many([DoctorJob(script=str(script), args=("--epochs", "3"), steps=2, warmup=1, source=source)],
                        quiet=True)[0]
    assert run.status == "stopped", run.traceback
    assert run.observation["model"]["autocast"] is True


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_fused_optimizer_patch_on_a_gpt_script_that_fuses_only_on_cuda(tmp_path):
    from torchspeed.doctor import DoctorJob, diagnose_many

    ctx = PatchContext(device="cpu")
    assert "SGD(model.parameters(), lr=0.1, fused=True)" in apply_patch(
        "fused_optimizer", "import torch\nopt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)\n", ctx)
    script = SCRIPTS / "gpt_fused_cuda_only.py"
    out = apply_patch("fused_optimizer", script.read_text(), ctx)
    assert ('torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, '
            '**{**extra_args, "fused": True, "foreach": None})') in out
    # the patched script runs, and the optimizer it builds is fused
    run = diagnose_many([DoctorJob(script=str(script), steps=2, warmup=1, source=out)], quiet=True)[0]
    assert run.status == "stopped", run.traceback
    assert run.observation["optimizer"]["fused"] is True
    assert "optimizer-kernel" not in run.rules


WORD_LM = textwrap.dedent('''
    import torch
    from torch import nn

    class RNNModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.decoder = nn.LSTM(8, 8), nn.Linear(8, 4)

        def forward(self, x, hidden):
            out, hidden = self.rnn(x, hidden)
            return self.decoder(out), hidden

        def init_hidden(self, bsz):
            w = next(self.parameters())
            return w.new_zeros(1, bsz, 8), w.new_zeros(1, bsz, 8)

    model = RNNModel()
    hidden = model.init_hidden(2)
    for i in range(3):
        model.zero_grad()
        output, hidden = model(torch.randn(5, 2, 8), tuple(h.detach() for h in hidden))
        output.sum().backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
''')


class _RecordedAutocast:
    """Stands in for `torch.autocast` while a patched script runs: records each entry and runs the body in fp32, so
    the test does not depend on the CPU's bf16 kernels (oneDNN has no bf16 LSTM where the CPU lacks native bf16)."""

    entered: list = []

    def __init__(self, device_type, dtype=None, **kwargs):
        self.args = (device_type, dtype)

    def __enter__(self):
        type(self).entered.append(self.args)
        return self

    def __exit__(self, *exc):
        return False


def test_a_models_own_self_parameters_does_not_hide_the_model_from_the_autocast_patch(monkeypatch):
    out = apply_patch("autocast", WORD_LM, PatchContext(device="cpu"))  # it read `self` as a second model before
    assert 'with torch.autocast("cpu", dtype=torch.bfloat16):\n        output, hidden = model(' in out
    monkeypatch.setattr(_RecordedAutocast, "entered", [])
    monkeypatch.setattr(torch, "autocast", _RecordedAutocast)
    exec(compile(out, "word_lm_patched.py", "exec"), {})  # the patched script runs, its model calls under autocast
    assert _RecordedAutocast.entered == [("cpu", torch.bfloat16)] * 3


def test_batched_index_keeps_the_loaders_batches_and_refuses_a_loader_that_batches_its_own_way():
    """The patched loader gives the original's batches in the original's order (the same generator, a `shuffle`
    read from a variable, the workers kept); a sampler, collate_fn, positional shuffle or **kwargs: not patched."""
    src = textwrap.dedent('''
        from torch.utils.data import DataLoader, TensorDataset
        X = __import__("torch").arange(40.0).reshape(20, 2)
        ds = TensorDataset(X, X[:, 0])
        shuf = True
        loader = DataLoader(ds, batch_size=6, shuffle=shuf, drop_last=True,
                            generator=__import__("torch").Generator().manual_seed(3))
        inline = [b for b in (x for x in DataLoader(TensorDataset(X), batch_size=8) if len(x[0]) == 8)]
    ''')
    out = fix_mod.with_torch_imported(apply_patch("batched_index", src, PatchContext()), src)
    assert "import torch\n" in out and "_ds :=" not in out  # no walrus: a comprehension's iterable refuses one
    before, after = {}, {}
    exec(compile(src, "orig.py", "exec"), before)
    exec(compile(out, "patched.py", "exec"), after)
    first = [[t.tolist() for t in b] for b in before["loader"]]
    assert first == [[t.tolist() for t in b] for b in after["loader"]] and len(first) == 3
    assert [[t.tolist() for t in b] for b in before["inline"]] == [[t.tolist() for t in b] for b in after["inline"]]
    for own in ("DataLoader(ds, 16, True)", "DataLoader(ds, batch_size=4, sampler=s)",
                "DataLoader(ds, batch_size=4, collate_fn=f)", "DataLoader(ds, **kw)"):
        with pytest.raises(NotApplicable, match="batches its own way"):
            apply_patch("batched_index", f"ds = TensorDataset(X, X)\nloader = {own}\n", PatchContext())


def test_a_patch_that_would_not_compile_is_skipped_with_its_reason(monkeypatch):
    """`--fix` skips a patch whose result is not valid Python (and says why) instead of failing the report."""
    from types import SimpleNamespace

    monkeypatch.setattr(fix_mod, "apply_patch", lambda name, source, ctx: source + "\nx := 1\n")
    f = SimpleNamespace(rule="data-bound", patch="batched_index", patch_args=None, also=())
    report = SimpleNamespace(script="train.py", observation={}, findings=[f])
    candidates, skipped = plan_patches(report, "print(1)\n")
    assert candidates == [] and skipped[0]["patch"] == "batched_index" and "would not compile" in skipped[0]["reason"]

"""Sturdier evidence: robust step shares, used-by-gradient modules, in-memory data, workers chosen by the
tuner, CPU-dependent rules under injected CPU profiles, Dynamo log parsing, the schema in the JSON."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.doctor import RULES, run_rules
from torchspeed.doctor import verify as verify_mod
from torchspeed.doctor._capture import Captured
from torchspeed.doctor._compile_log import parse_record
from torchspeed.doctor._model_checks import examine_model
from torchspeed.doctor._probe import Probe
from torchspeed.doctor._summary import _in_memory, own_batching, summarize

from test_rules import CLEAN, CPU_ENV, _obs, _set

AVX2 = {**CPU_ENV, "bf16_supported": False, "amx": False}
AVX512 = {**CPU_ENV, "bf16_supported": False, "amx": False}
AVX512_BF16 = {**CPU_ENV, "bf16_supported": True, "amx": False}
AMX = {**CPU_ENV, "bf16_supported": True, "amx": True}


def _probe_with(records):
    p = Probe(steps=len(records) - 2, warmup=2)
    p.records = records
    return p


def test_start_up_outliers_do_not_make_a_loop_data_bound():
    # 2 warm-up steps, then 10 steps of 10 ms with 0.2 ms data wait, one of which waits 150 ms for workers
    steady = {"data": 0.2, "forward": 4.0, "backward": 4.8, "optim": 1.0, "step": 10.0}
    recs = [dict(steady) for _ in range(12)]
    recs[6] = {**steady, "data": 150.2, "step": 160.0}
    obs = copy.deepcopy(CLEAN)
    summarize(_probe_with(recs), obs)
    b = obs["breakdown"]
    assert b["outlier_steps"] == 1 and b["outlier_step_ms"] == [160.0] and b["steps"] == 9
    assert b["fractions"]["data_wait"] == pytest.approx(0.02) and b["step_ms_mean_all"] == 25.0
    assert RULES["data-bound"].check(obs) is None
    # a loop that waits at every step is still data-bound
    recs = [{**steady, "data": 5.2, "step": 15.0} for _ in range(12)]
    summarize(_probe_with(recs), obs)
    assert RULES["data-bound"].check(obs) is not None


def test_the_median_steps_share_guards_the_verdict():
    # waits spread over two steps in nine (no single outlier): the median step waits for nothing
    o = _obs(_set("breakdown.fractions.data_wait", 0.3), _set("breakdown.fractions_median", {"data": 0.01}))
    assert RULES["data-bound"].check(o) is None
    o["breakdown"]["fractions_median"]["data"] = 0.3
    assert RULES["data-bound"].check(o) is not None


def _called_and_grads(model, x):
    called = set()
    hooks = [m.register_forward_pre_hook(lambda mod, a: called.add(id(mod))) for m in model.modules()]
    model(x).square().mean().backward()
    for h in hooks:
        h.remove()
    return called, {id(p) for p in model.parameters() if p.grad is not None}


def test_a_module_whose_parameters_get_gradients_is_used():
    torch.manual_seed(0)

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, batch_first=True)
            self.aux = nn.Linear(16, 64)  # really unused

        def forward(self, x):
            return self.layer(x)

    model, x = Enc(), torch.randn(4, 6, 16)
    called, grads = _called_and_grads(model, x)
    assert id(model.layer.self_attn.out_proj) not in called  # MultiheadAttention uses it functionally
    obs = {"notes": [], "env": {}}
    examine_model(Captured(model=model, args=(x,), called=called, grad_ids=grads), obs)
    assert obs["model"]["never_called_modules"] == ["aux"]


def test_in_memory_data_is_told_to_index_whole_batches_never_to_add_workers():
    o = _obs(_set("breakdown.fractions.data_wait", 0.6), _set("breakdown.data_wait_ms", 6.0),
             _set("loaders", [{**CLEAN["loaders"][0], "num_workers": 0, "dataset": "TensorDataset",
                               "in_memory": True}]))
    f = RULES["data-bound"].check(o)
    assert "index whole batches" in f.fix and "num_workers" not in f.fix
    assert RULES["dataloader-workers"].check(o) is None


def test_in_memory_data_batched_its_own_way_gets_the_advice_but_no_patch_that_would_drop_it():
    ds = TensorDataset(torch.randn(8, 3), torch.arange(8))
    assert own_batching(DataLoader(ds, batch_size=4, shuffle=True)) == []
    whole = DataLoader(ds, batch_size=None, sampler=torch.utils.data.BatchSampler(
        torch.utils.data.RandomSampler(ds), 4, drop_last=False))  # what batched_index writes
    assert own_batching(whole) == []
    assert own_batching(DataLoader(ds, batch_size=4, collate_fn=lambda b: b)) == ["collate_fn"]
    assert own_batching(DataLoader(ds, batch_size=4, sampler=torch.utils.data.WeightedRandomSampler(
        [1.0] * 8, 8))) == ["sampler"]
    base = _obs(_set("breakdown.fractions.data_wait", 0.6), _set("breakdown.data_wait_ms", 6.0),
                _set("loaders", [{**CLEAN["loaders"][0], "num_workers": 0, "dataset": "TensorDataset",
                                  "in_memory": True, "own_batching": []}]))
    assert RULES["data-bound"].check(base).patch == "batched_index"
    own = copy.deepcopy(base)
    own["loaders"][0]["own_batching"] = ["collate_fn"]
    f = RULES["data-bound"].check(own)
    assert f.patch is None and "index whole batches" in f.fix and "(collate_fn)" in f.fix


class _Rows(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class _Noisy(_Rows):
    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn_like(self.x[i]), self.y[i]


def test_a_dataset_of_your_own_that_only_indexes_its_tensors_counts_as_in_memory():
    x, y = torch.randn(12, 3), torch.arange(12)
    assert _in_memory(_Rows(x, y)) and _in_memory(TensorDataset(x, y))
    assert not _in_memory(_Noisy(x, y))  # it computes its samples: workers may help it, slicing would change it


def _workers_verdict(direction, candidate, current, speedup):
    return _set("verify", {"workers": {"fix": "workers", "speedup": speedup, "baseline_ms": 10.0,
                                       "candidate_ms": 10.0 / speedup, "rounds": 3, "within_noise": False,
                                       "iqr": [speedup, speedup], "direction": direction,
                                       "candidate": candidate, "current": current}})


def test_fewer_workers_is_advised_when_measured_and_workers_never_against_the_tuner():
    slow = (_set("breakdown.fractions.data_wait", 0.5), _set("breakdown.data_wait_ms", 5.0))
    o = _obs(*slow, _workers_verdict("fewer", "num_workers=0", "num_workers=2", 1.8))
    f = RULES["data-bound"].check(o)
    assert f.fix.startswith("use fewer workers: num_workers=0") and f.measured_gain == 1.8
    # the script loads in the main process and the tuner keeps it there: no advice to add workers
    zero = _set("loaders", [{**CLEAN["loaders"][0], "num_workers": 0}])
    o = _obs(*slow, zero, _workers_verdict("same", "num_workers=0", "num_workers=0", 1.0))
    assert RULES["dataloader-workers"].check(o) is None
    o = _obs(*slow, zero, _workers_verdict("more", "num_workers=2", "num_workers=0", 1.4))
    assert "num_workers=2" in RULES["dataloader-workers"].check(o).fix


def test_verify_tries_the_worker_count_the_tuner_chooses(monkeypatch):
    chosen = {}

    def fake_tune_loader(dataset, **kw):
        chosen["called"] = kw["batch_size"]
        return type("S", (), {"num_workers": 0, "reason": "workers do not help (injected)"})()

    monkeypatch.setattr(verify_mod, "tune_loader", fake_tune_loader)  # the tuner verify calls
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ds = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
    loader = DataLoader(ds, batch_size=16, num_workers=1)
    cap = Captured(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), args=(torch.randn(16, 8),),
                   loss_module=nn.CrossEntropyLoss(), target=torch.randint(0, 4, (16,)), loaders=[loader])
    res = verify_mod.verify_fixes(cap, {"model": {"autocast": True}, "notes": []}, fixes=("workers",), rounds=1)
    w = res["workers"]
    assert "error" not in w, w
    assert chosen["called"] == 16 and w["candidate"] == "num_workers=0" and w["direction"] == "fewer"
    assert w["current"] == "num_workers=1" and "injected" in w["tuner"] and w["rule"] == "data-bound"


@pytest.mark.parametrize("env,fires", [(AVX2, False), (AVX512, False), (AVX512_BF16, True), (AMX, True)])
def test_cpu_bf16_math_follows_the_injected_cpu(env, fires):
    o = _obs(_set("env", env), _set("model.autocast", False))
    f = RULES["cpu-bf16-math"].check(o)
    assert (f is not None) == fires
    if fires:
        assert ("AMX" in f.evidence) == env["amx"] and 'fp32_precision = "bf16"' in f.fix
        o["math"]["mkldnn_matmul"] = "bf16"  # already on: nothing to say
        assert RULES["cpu-bf16-math"].check(o) is None


def test_cpu_bf16_math_leaves_small_matrix_products_alone():
    """A small MLP's products (a few us a call) are dispatch-bound: bf16 saves nothing, no finding; large ones do."""
    for us, fires in ((4.0, False), (300.0, True), (None, True)):  # None: not counted, the share decides
        o = _obs(_set("env", AVX512_BF16), _set("model.autocast", False), _set("kernels.matmul_us_per_call", us))
        assert (RULES["cpu-bf16-math"].check(o) is not None) == fires, us


def test_matrix_products_are_counted_once_a_call():
    """`aten::matmul` calling `aten::mm` is one product; a convolution is one; the profiler's own tree."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torchspeed.doctor._kernels import matmul_calls
    a, b, x, w = torch.randn(8, 8), torch.randn(8, 8), torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.matmul(a, b)
        torch.nn.functional.conv2d(x, w)
        torch.relu(a)
    assert matmul_calls(prof.events()) == 2


def test_allocator_needs_glibc_and_fault_churn():
    churn = _set("breakdown.minor_faults_per_step", 6000.0)
    assert RULES["allocator"].check(_obs(churn)) is not None
    assert RULES["allocator"].check(_obs(churn, _set("env", {**CPU_ENV, "allocator": "tcmalloc"}))) is None
    assert RULES["allocator"].check(_obs(churn, _set("env", {**CPU_ENV, "allocator": "glibc (tuned)"}))) is None
    f = RULES["allocator"].check(_obs(churn, _set("env", {**CPU_ENV, "tcmalloc_path": "/x/libtcmalloc.so.4"})))
    assert "LD_PRELOAD=/x/libtcmalloc.so.4" in f.fix


def test_oversubscription_needs_the_measured_slow_down():
    over = {"workers": 2, "threads": 2, "cores": 2, "compute_ms_in_script": 9.0, "worker_ms_per_batch": 4.0}
    assert RULES["cpu-oversubscribed"].check(_obs(_set("cpu", {**over, "compute_ms_alone": 6.0}))) is not None
    assert RULES["cpu-oversubscribed"].check(_obs(_set("cpu", {**over, "compute_ms_alone": 8.5}))) is None
    assert RULES["cpu-oversubscribed"].check(_obs(_set("cpu", {**over, "compute_ms_alone": None}))) is None
    within = {**over, "threads": 0, "compute_ms_alone": 6.0}
    assert RULES["cpu-oversubscribed"].check(_obs(_set("cpu", within))) is None
    # idle workers (0.1 ms of work per batch) cannot explain 3 ms lost: the machine's other load does
    idle = {**over, "compute_ms_alone": 6.0, "worker_ms_per_batch": 0.1}
    assert RULES["cpu-oversubscribed"].check(_obs(_set("cpu", idle))) is None


def test_dynamo_records_are_parsed_and_the_probes_own_guards_dropped():
    gb = ("Graph break in user code at /home/u/train.py:42\nGraph Break Reason: Data-dependent branching\n"
          "  Explanation: Detected data-dependent branching.\n")
    assert parse_record("graph_break", gb) == {"kind": "graph_break", "site": "train.py:42",
                                               "reason": "Data-dependent branching (Detected data-dependent branching.)"}
    rc = ("Recompiling function forward in /home/u/train.py:12\n    triggered by the following guard failure(s):\n"
          "    - 0/0: tensor 'x' size mismatch at index 0. expected 8, actual 9")
    assert parse_record("recompile", rc)["reason"] == "forward: 0/0: tensor 'x' size mismatch at index 0. expected 8, actual 9"
    own = rc.replace("tensor 'x' size mismatch at index 0. expected 8, actual 9",
                     "G['m']._global_forward_pre_hooks[5].__self__.called == {1, 2}")
    assert parse_record("recompile", own) == {}


def test_every_rule_states_an_estimate_or_a_severity_on_its_trigger():
    from test_rules import TRIGGERS

    from torchspeed.doctor._patch_base import PATCHES
    from torchspeed.doctor import _patches  # noqa: F401  (registers every patch)

    patched = set()
    for rid, mods in TRIGGERS.items():
        f = RULES[rid].check(_obs(*mods))
        assert f.est_gain is None or f.est_gain > 0, rid
        assert f.patch is None or f.patch in PATCHES, (rid, f.patch)  # a patch --fix can write
        patched.add(f.patch)
    assert {"set_to_none", "channels_last", "compile", "threads", "bf16_math", "debug_off", "workers"} <= patched
    assert run_rules(_obs()) == []


def test_data_bound_evidence_names_the_loader():
    o = _obs(_set("breakdown.fractions.data_wait", 0.6), _set("breakdown.data_wait_ms", 6.0))
    ev = RULES["data-bound"].check(o).evidence
    assert "DataLoader(DS, num_workers=2)" in ev and "{" not in ev


def test_tensor_copies_in_a_datasets_items_are_reported():
    item = {"per_item": 1.0, "ms_per_item": 0.01, "float64": True, "sites": ["ds.py:12"]}
    ds = [{**CLEAN["datasets"][0], "tensor_copies": item}]
    f = RULES["tensor-copy"].check(_obs(_set("datasets", ds)))
    assert f is not None and "DS[i] at ds.py:12" in f.evidence and "64 per batch of 64" in f.evidence
    assert "2 DataLoader worker(s)" in f.evidence and "astype(np.float32)" in f.fix
    assert f.severity == "low" and f.est_gain is None  # in workers it costs the loading side, not the step
    ds[0]["tensor_copies"] = {**item, "per_item": 0.0}
    assert RULES["tensor-copy"].check(_obs(_set("datasets", ds))) is None


def test_the_probe_counts_torch_tensor_on_numpy_scalars_and_float64_arrays():
    import numpy as np

    from torchspeed.doctor._sites import count_tensor_copies, new_copy_counts

    c = new_copy_counts()
    tensor = count_tensor_copies(c, torch.tensor)
    tensor(np.zeros(4))                      # float64 array
    tensor(np.float32(1.0))                  # numpy scalar
    tensor([np.zeros(2, np.float32)] * 2)    # list of arrays
    tensor([1.0, 2.0])                       # plain Python data: not a numpy copy
    assert c["count"] == 3 and c["float64"] == 1 and sum(c["sites"].values()) == 3


def test_the_batch_of_a_sequence_first_model_is_the_inputs_second_dimension():
    from torchspeed.doctor._model_checks import _batch_dim

    tokens = torch.zeros(35, 20, dtype=torch.long)  # (T, B), as the word-language-model example feeds its LSTM
    seq_first = nn.Sequential(nn.Embedding(10, 8), nn.LSTM(8, 8))
    assert _batch_dim(seq_first, tokens) == 1
    assert _batch_dim(nn.Sequential(nn.Embedding(10, 8), nn.LSTM(8, 8, batch_first=True)), tokens) == 0
    assert _batch_dim(nn.Linear(4, 2), torch.zeros(16, 4)) == 0  # nothing sequence-first: the first dimension
    mixed = nn.ModuleList([nn.LSTM(8, 8), nn.TransformerEncoderLayer(8, 2, batch_first=True)])
    assert _batch_dim(mixed, tokens) == 0  # layers that disagree: the usual first dimension


def _render(obs) -> str:
    from rich.console import Console

    from torchspeed.doctor import render_report, report_from_observation

    console = Console(record=True, width=300)
    render_report(report_from_observation({**obs, "script": "train.py"}), console)
    return console.export_text()


def test_a_run_that_ended_within_the_warm_up_says_its_step_time_is_rough():
    steady = {"data": 0.2, "forward": 4.0, "backward": 4.8, "optim": 1.0, "step": 10.0}
    p = Probe(steps=30, warmup=5)
    p.records = [dict(steady) for _ in range(4)]  # the script raised at its 4th step, warm-up 5
    obs = copy.deepcopy(CLEAN)
    summarize(p, obs)
    assert obs["breakdown"]["within_warmup"] and obs["breakdown"]["steps"] == 3
    text = _render(obs)
    assert "trimmed mean of 3 steps, all within warm-up: rough" in text and "after warm-up" not in text
    p.records = [dict(steady) for _ in range(8)]
    summarize(p, obs)
    assert not obs["breakdown"]["within_warmup"]
    assert "trimmed mean of 3 steps after warm-up" in _render(obs)


def test_a_copy_made_once_while_loading_is_no_per_step_cost():
    import numpy as np

    from torchspeed.doctor._probe import StopScript

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    probe = Probe(steps=3, warmup=2)
    with pytest.raises(StopScript), probe:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # made under the probe: its steps end the steps
        x = torch.tensor(np.zeros((8, 4), np.float32))  # TensorDataset(torch.tensor(Xtr), ...) before training
        for _ in range(10):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    obs = copy.deepcopy(CLEAN)
    summarize(probe, obs)
    c = obs["tensor_copies"]
    assert c["count"] == 1 and c["per_step"] == 0.0 and c["ms_per_step"] == 0.0
    assert RULES["tensor-copy"].check(obs) is None
    # a copy in every step is a per-step cost
    probe = Probe(steps=3, warmup=2)
    with pytest.raises(StopScript), probe:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(10):
            x = torch.tensor(np.zeros((8, 4), np.float32))
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    summarize(probe, obs)
    assert obs["tensor_copies"]["count"] == 5 and obs["tensor_copies"]["per_step"] == 1.0
    assert RULES["tensor-copy"].check(obs) is not None
    # fewer than one a step (an evaluation every few steps) is no per-step cost either
    few = _set("tensor_copies", {"count": 4, "per_step": 0.5, "ms_per_step": 0.001, "mib": 0.1, "sites": ["t.py:3"]})
    assert RULES["tensor-copy"].check(_obs(few)) is None


def test_a_run_with_no_step_gets_only_the_rules_that_do_not_rest_on_the_step():
    from torchspeed.doctor._summary import no_steps_note

    obs = _obs(_set("model.autocast", False), _set("debug.anomaly_detection", True), _set("steps_observed", 0))
    assert {f.rule for f in run_rules(obs)} == {"debug-mode-on"}  # no-amp would read a 0 ms breakdown
    obs["steps_observed"] = 30
    assert {"no-amp", "debug-mode-on"} <= {f.rule for f in run_rules(obs)}
    p = Probe(steps=30, warmup=5)
    p.optimizers_made = 1
    obs = copy.deepcopy(CLEAN)
    summarize(p, obs)
    assert obs["steps_observed"] == 0 and obs["optimizers_made"] == 1
    assert obs["notes"] == [no_steps_note(1)] and "step() was never called" in obs["notes"][0]
    assert "made no torch optimizer and called no backward()" in no_steps_note(0)


def test_the_doctors_own_profiling_prints_no_kineto_lines_into_the_scripts_output():
    import os
    import subprocess
    import sys

    from torchspeed.doctor._kernels import KINETO_ENV, quiet_kineto

    environ = {}
    with quiet_kineto(environ):
        assert environ == {KINETO_ENV: "6"}
    assert environ == {}  # put back: the script's environment is its own
    environ = {KINETO_ENV: "1"}
    with quiet_kineto(environ):
        assert environ == {KINETO_ENV: "1"}  # the user's own level stands
    # kineto reads the level once, when a process first profiles: a fresh process, as the script's is
    code = ("import torch\nfrom torch import nn\nfrom torchspeed.doctor._capture import Captured\n"
            "from torchspeed.doctor._kernels import profile_kernels\n"
            "obs = {'notes': []}\n"
            "profile_kernels(Captured(model=nn.Linear(4, 2), args=(torch.randn(3, 4),)), obs)\n"
            "print('shares', 'kernels' in obs, obs['notes'])\n")
    env = {k: v for k, v in os.environ.items() if k != KINETO_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "shares True []" in out.stdout, (out.stdout, out.stderr)
    assert "SyncActivityProfilerHandler" not in out.stdout + out.stderr and "profiler_start" not in out.stderr

"""Every registered rule, on synthetic observations: it fires on its problem, stays quiet on a
clean observation, and its severity follows the cost on the device (and --verify's measurement).

The loop is over the registry, so a new rule file is covered once it has a TRIGGERS entry.
"""

import copy
from pathlib import Path

import pytest

from torchspeed.doctor import RULES, rule_ids, run_rules
from torchspeed.doctor._summary import training_loop
from torchspeed.doctor.registry import severity_for_gain

RULE_IDS = rule_ids()

CPU_ENV = {"device": "cpu", "cuda_available": False, "bf16_supported": False, "compute_capability": None,
           "cpu_cores": 2, "amx": False, "allocator": "glibc", "tcmalloc_path": None}
BF16_CPU = {**CPU_ENV, "bf16_supported": True}

CLEAN = {
    "env": CPU_ENV, "cpu_cores": 2, "steps_observed": 30, "status": "stopped", "cudnn_benchmark": False,
    "breakdown": {"step_ms": 10.0, "data_wait_ms": 0.2, "copy_ms": 0.0, "compute_ms": 9.0, "sync_ms": 0.0,
                  "other_ms": 0.8, "fractions": {"data_wait": 0.02, "copy": 0.0, "compute": 0.9, "sync": 0.0,
                                                 "other": 0.08}, "steps": 30},
    "syncs": {"calls": 0, "by_kind": {}, "calls_per_step": 0.0, "ms_per_step": 0.0, "sites": []},
    "tensor_copies": {"count": 0, "per_step": 0.0, "ms_per_step": 0.0, "mib": 0.0, "sites": []},
    "zero_grad": {"calls": 30, "set_to_none_false": 0, "ms_per_call": 0.0, "sites": []},
    "eval": {"calls": 4, "grad_calls": 0, "ms": 4.0, "grad_ms": 0.0},
    "loaders": [{"num_workers": 2, "pin_memory": True, "batch_size": 64, "dataset": "DS", "map_style": True,
                 "persistent_workers": True, "wait_ms_total": 5.0}],
    "datasets": [{"dataset": "DS", "getitem_ms": 0.1, "decode_ms": 0.0, "transform_ms": 0.05, "other_ms": 0.05,
                  "decode_share": 0.0, "decoders": {}, "batch_size": 64}],
    "model": {"found": True, "device": "cpu", "has_conv2d": True, "channels_last_weights": True, "autocast": True,
              "data_parallel": False, "conv_bias_before_bn": [], "odd_sizes": [], "batch_size": 64,
              "unused_params": [], "unused_param_count": 0, "unused_param_fraction": 0.0, "never_called_modules": [],
              "design": {"grouped_convs": 0, "grouped_time_share": 0.0, "grouped_flops_share": 0.0},
              "input": {"dtype": "torch.float32", "mean": 0.0, "std": 1.0, "min": -3.0, "max": 3.0}},
    "kernels": {"matmul_share": 0.6, "elementwise_share": 0.2, "ms_per_step": 8.0, "top": ["mm 50%"]},
    "debug": {"anomaly_detection": False, "profiler": False, "deterministic": False},
    "math": {"mkldnn_matmul": "none", "mkldnn_conv": "none", "float32_matmul_precision": "highest"},
    "compile": {"graph_breaks": [], "recompiles": []},
    "cpu": {"workers": 2, "threads": 1, "cores": 2, "compute_ms_in_script": 9.0, "compute_ms_alone": 8.8,
            "worker_ms_per_batch": 4.0},
    "threads": 1,
    "notes": [],
}
CLEAN["breakdown"]["minor_faults_per_step"] = 40.0


def _cuda(o):
    o["env"] = {**CPU_ENV, "device": "cuda", "cuda_available": True, "compute_capability": (8, 0)}
    o["model"]["device"] = "cuda:0"


def _set(path, value):
    def f(o):
        d = o
        keys = path.split(".")
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return f


def _slow_data(o):
    o["breakdown"].update(data_wait_ms=6.0, compute_ms=3.5, other_ms=0.5)
    o["breakdown"]["fractions"].update(data_wait=0.6, compute=0.35)


def _workers0(o):
    _slow_data(o)
    o["loaders"][0]["num_workers"] = 0


def _pil(o):
    _workers0(o)
    o["datasets"][0].update(decoders={"PIL JPEG": 24}, decode_ms=0.6, decode_share=0.6,
                            alt_decode={"best": "simplejpeg", "speedup": 3.0})


def _pin(o):
    _cuda(o)
    o["loaders"][0]["pin_memory"] = False


def _design(o):
    o["model"]["design"] = {"grouped_convs": 4, "grouped_time_share": 0.6, "grouped_flops_share": 0.1}


def _oversubscribed(o):
    o["cpu"] = {"workers": 2, "threads": 2, "cores": 2, "compute_ms_in_script": 9.0, "compute_ms_alone": 6.0,
                "worker_ms_per_batch": 4.0}


def _no_autocast_bf16_cpu(o):
    o["env"] = BF16_CPU
    o["model"]["autocast"] = False


TRIGGERS = {
    "data-bound": [_slow_data],
    "dataloader-workers": [_workers0],
    "pin-memory": [_pin],
    "slow-jpeg-decode": [_pil],
    "tensor-copy": [_set("tensor_copies", {"count": 64, "per_step": 64.0, "ms_per_step": 2.0, "mib": 1.0,
                                           "sites": ["ds.py:9 (64x)"]})],
    "host-sync": [_set("syncs", {"calls": 60, "by_kind": {"item": 60}, "calls_per_step": 2.0, "ms_per_step": 0.01,
                                 "sites": ["train.py:30 (60x)"]})],
    "no-amp": [_set("model.autocast", False)],
    "channels-last": [_set("model.channels_last_weights", False)],
    "cudnn-benchmark": [_cuda],
    "zero-grad-memset": [_set("zero_grad", {"calls": 30, "set_to_none_false": 30, "ms_per_call": 0.1,
                                            "sites": ["t.py:3 (30x)"]})],
    "eval-grad-enabled": [_set("eval", {"calls": 4, "grad_calls": 4, "ms": 4.0, "grad_ms": 4.0})],
    "conv-bias-before-bn": [_set("model.conv_bias_before_bn", ["conv1 -> bn1"])],
    "data-parallel": [_set("model.data_parallel", True)],
    "size-not-multiple-of-8": [_set("model.odd_sizes", ["fc1.out_features=100"])],
    "unused-parameters": [_set("model.unused_params", ["aux.weight", "aux.bias"]),
                          _set("model.unused_param_count", 2), _set("model.unused_param_fraction", 0.5)],
    "small-batch": [_set("model.batch_size", 4)],
    "model-design": [_design],
    "cpu-oversubscribed": [_oversubscribed],
    "omp-wait-policy": [_oversubscribed, _set("env_fixes", {"omp_passive": {
        "fix": "omp_passive", "rule": "omp-wait-policy", "env": {"OMP_WAIT_POLICY": "PASSIVE"}, "steps": 6,
        "speedup": 1.2, "ratios": [1.18, 1.22], "iqr": [1.19, 1.21], "within_noise": False, "rounds": 2,
        "baseline_ms": 12.0, "candidate_ms": 10.0}})],
    "elementwise-bound": [_set("kernels.elementwise_share", 0.55)],
    "layout-copies": [_set("kernels.layout_share", 0.3)],
    "compile-graph-breaks": [_set("compile.graph_breaks", [{"site": "train.py:12", "reason": "Data-dependent "
                                                            "branching", "count": 3}])],
    "debug-mode-on": [_set("debug.anomaly_detection", True)],
    "cpu-bf16-math": [_no_autocast_bf16_cpu],
    "allocator": [_set("breakdown.minor_faults_per_step", 6000.0)],
    "optimizer-kernel": [_set("optimizer", {"class": "AdamW", "fused": None, "foreach": None, "device": "cpu",
                                            "fused_available": True, "param_tensors": 28}),
                         _set("breakdown.compute_detail_ms", {"forward": 3.0, "backward": 5.0, "optimizer": 1.0,
                                                              "zero_grad": 0.0})],
    "sparse-momentum": [_set("optimizer", {"class": "SGD", "fused": None, "foreach": None, "device": "cpu",
                                           "fused_available": False, "param_tensors": 3, "sparse_momentum": 1}),
                        _set("breakdown.optimizer_ms_thirds", [0.5, 2.5])],
    "cpu-threads": [_set("threads", 4), _set("machine_cores", 8)],  # 4 threads, an affinity of 2 of 8 cores
    "amx-old-kernel": [_set("env", {**CPU_ENV, "amx": True, "bf16_supported": True}),
                       _set("kernel", "5.15.0-91-generic")],
    "input-not-normalized": [_set("model.input", {"dtype": "torch.float32", "mean": 120.0, "std": 70.0,
                                                  "min": 0.0, "max": 255.0})],
}


def _obs(*mods):
    o = copy.deepcopy(CLEAN)
    for m in mods:
        m(o)
    return o


def test_registry_is_every_rule_file_one_rule_each():
    import torchspeed.doctor.rules
    folder = Path(torchspeed.doctor.rules.__file__).parent
    files = {p.stem for p in folder.glob("*.py") if not p.name.startswith("_")}
    assert {rid.replace("-", "_") for rid in RULE_IDS} == files
    assert {RULES[r].module.rsplit(".", 1)[1] for r in RULE_IDS} == files
    assert set(TRIGGERS) == set(RULE_IDS)
    prios = [RULES[r].priority for r in RULE_IDS]
    assert prios == sorted(prios) and len(set(prios)) == len(prios)


def test_clean_observation_has_no_findings():
    assert run_rules(_obs()) == []
    cuda_clean = _obs(_cuda, _set("cudnn_benchmark", True))
    assert run_rules(cuda_clean) == []


@pytest.mark.parametrize("rule_id", RULE_IDS)
def test_rule_fires_on_its_problem(rule_id):
    obs = _obs(*TRIGGERS[rule_id])
    f = RULES[rule_id].check(obs)
    assert f is not None and f.rule == rule_id
    assert f.severity in ("high", "medium", "low") and f.evidence and f.fix
    d = f.to_dict()
    assert set(d) == {"rule", "severity", "evidence", "fix", "est_gain", "measured_gain", "patch", "basis", "also",
                      "interval", "inconclusive", "ceiling"}
    assert d["basis"] in ("measured", "timed", "estimated")
    if d["basis"] == "estimated":  # nothing measured on the script: never ranked above low
        assert f.severity == "low" and (f.est_gain is None or "estimated, not measured" in f.evidence)
    assert d["est_gain"] is None or isinstance(d["est_gain"], float)
    assert RULES[rule_id].check(_obs()) is None  # and only there


def test_host_sync_severity_follows_the_device_and_its_timed_cost():
    sync = TRIGGERS["host-sync"][0]
    assert RULES["host-sync"].check(_obs(sync)).severity == "low"  # microseconds on a CPU
    # on CUDA the rule allows medium (high at >= 5 per step); the timed stall decides within that
    slow = _set("syncs.ms_per_step", 3.0)
    assert RULES["host-sync"].check(_obs(sync, _cuda)).severity == "low"  # 0.01 ms timed: nothing to gain
    assert RULES["host-sync"].check(_obs(sync, slow, _cuda)).severity == "medium"
    many = _set("syncs.calls_per_step", 8.0)
    assert RULES["host-sync"].check(_obs(sync, many, slow, _cuda)).severity == "high"


def test_no_amp_follows_what_the_machine_runs_fast():
    no_amp = TRIGGERS["no-amp"][0]
    f = RULES["no-amp"].check(_obs(no_amp))
    assert f.severity == "low" and f.est_gain < 1 and f.fix.startswith("keep fp32")
    bf16_cpu = _set("env", {**CPU_ENV, "bf16_supported": True})
    f = RULES["no-amp"].check(_obs(no_amp, bf16_cpu))
    # a model of the machine says 1.4x: estimated, so low until --verify or --fix measures it
    assert f.est_gain > 1.25 and f.severity == "low" and "torch.autocast('cpu'" in f.fix
    assert f.basis == "estimated" and "estimated, not measured" in f.evidence
    f = RULES["no-amp"].check(_obs(no_amp, _cuda))
    assert f.severity == "low" and "torch.autocast('cuda'" in f.fix


def test_no_amp_names_the_frameworks_setting_when_its_loop_trains_the_model():
    bf16_cpu = _set("env", {**CPU_ENV, "bf16_supported": True})
    f = RULES["no-amp"].check(_obs(TRIGGERS["no-amp"][0], bf16_cpu, _set("loop", "lightning")))
    assert f.fix.startswith('precision="bf16-mixed" in L.Trainer') and "torch.autocast('cpu'" in f.fix
    assert f.patch is None  # --fix does not edit a forward the framework runs
    f = RULES["no-amp"].check(_obs(TRIGGERS["no-amp"][0], _cuda, _set("loop", "transformers")))
    assert f.fix.startswith("TrainingArguments(..., bf16=True)")
    assert training_loop({"torch", "lightning", "lightning.pytorch"}) == "lightning"
    assert training_loop({"torch", "transformers", "transformers.trainer"}) == "transformers"
    assert training_loop({"torch", "transformers"}) is None  # a model from transformers in a loop of your own


def _verified(fix, speedup, iqr, within_noise=False):
    return _set("verify", {fix: {"fix": fix, "speedup": speedup, "baseline_ms": 10.0, "candidate_ms": 10.0 / speedup,
                                 "rounds": 5, "within_noise": within_noise, "iqr": list(iqr)}})


def test_measured_gain_decides_the_severity_on_its_interval():
    no_amp = TRIGGERS["no-amp"][0]
    bf16 = _set("env", {**CPU_ENV, "bf16_supported": True})
    # (median, middle half of the rounds) -> severity: the threshold applies to the interval's low end
    cases = [(0.45, (0.43, 0.47), "low"), (1.1, (1.06, 1.14), "medium"), (1.1, (1.03, 1.14), "low"),
             (1.3, (1.27, 1.33), "high"), (1.3, (1.2, 1.4), "medium"), (1.6, (0.9, 2.0), "low")]
    for speedup, iqr, sev in cases:
        f = RULES["no-amp"].check(_obs(no_amp, bf16, _verified("autocast", speedup, iqr)))
        assert f.measured_gain == speedup and f.basis == "measured" and f.severity == sev, (speedup, iqr, f.severity)
        assert "--verify measured" in f.evidence and "estimated, not measured" not in f.evidence
        if speedup < 1:
            assert "slow-down" in f.evidence and f.fix.startswith("keep fp32")
            # the machine has native bf16: the slow-down is this model's, not an emulated bf16's
            assert "runs bf16 natively" in f.evidence and "no AVX512-BF16" not in f.evidence
    no_bf16 = RULES["no-amp"].check(_obs(no_amp, _verified("autocast", 0.5, (0.45, 0.55))))
    assert "no fast bf16 (no AVX512-BF16/AMX)" in no_bf16.evidence and "natively" not in no_bf16.evidence
    # below 5% is never more than low, whatever the interval
    assert severity_for_gain(1.049) == "low" and severity_for_gain(1.05) == "medium"


def test_model_derived_gains_are_low_and_say_so():
    # the allocator's page faults x an assumed cost per fault, the element-wise share x an assumed fusion
    # speed-up, cpu-bf16-math's matmul share x an assumed bf16 speed-up: big estimates, never ranked high
    faults = _set("breakdown.minor_faults_per_step", 60000.0)
    elementwise = _set("kernels.elementwise_share", 0.95)
    bf16 = _set("env", {**CPU_ENV, "bf16_supported": True})
    for rid, mods in (("allocator", [faults]), ("elementwise-bound", [elementwise]),
                      ("layout-copies", [_set("kernels.layout_share", 0.5)]),
                      ("cpu-bf16-math", [bf16, _set("model.autocast", False)]),
                      ("debug-mode-on", TRIGGERS["debug-mode-on"])):
        f = RULES[rid].check(_obs(*mods))
        assert f.severity == "low" and f.basis == "estimated", (rid, f)
        assert f.est_gain is None or (f.est_gain > 1.05 and "estimated, not measured" in f.evidence), rid
    # the same finding measured by --verify above 5% is ranked by that measurement
    f = RULES["elementwise-bound"].check(_obs(elementwise, _verified("compile", 1.4, (1.3, 1.5))))
    assert f.severity == "high" and f.basis == "measured" and f.measured_gain == 1.4
    # the data wait is timed by the probe: a gain from removing it may rank high without --verify
    f = RULES["dataloader-workers"].check(_obs(*TRIGGERS["dataloader-workers"]))
    assert f.basis == "timed" and f.severity == "high" and f.est_gain >= 1.25


def test_ranking_policy_switched_off_would_be_caught():
    # a rule that claims a big gain from a model: the registry (not the rule) keeps it low
    from torchspeed.doctor.registry import settle
    from torchspeed.doctor.report import Finding

    f = Finding("x", "high", "e", "f", est_gain=2.0)
    assert settle(f).severity == "low"
    assert settle(Finding("x", "high", "e", "f", est_gain=2.0, basis="timed")).severity == "high"
    assert settle(Finding("x", "medium", "e", "f", est_gain=2.0, basis="timed")).severity == "medium"  # ceiling
    assert settle(Finding("x", "low", "e", "f", est_gain=None, measured_gain=1.5, basis="measured",
                          interval=(1.4, 1.6))).severity == "high"  # a measurement decides alone


def test_one_finding_per_cause_fp32_math():
    # no-amp and cpu-bf16-math point at the same fp32 matmuls: one is ranked, the other named in it
    o = _obs(_set("env", {**CPU_ENV, "bf16_supported": True}), _set("model.autocast", False))
    found = run_rules(o)
    fp32 = [f for f in found if f.rule in ("no-amp", "cpu-bf16-math")]
    assert len(fp32) == 1 and [a.rule for a in fp32[0].also] == [{"no-amp": "cpu-bf16-math",
                                                                  "cpu-bf16-math": "no-amp"}[fp32[0].rule]]
    assert fp32[0].to_dict()["also"][0]["fix"]
    # the best measured fix wins: bf16 math measured faster than autocast -> cpu-bf16-math is the one ranked
    v = _set("verify", {"autocast": {"fix": "autocast", "speedup": 1.1, "baseline_ms": 10.0, "candidate_ms": 9.1,
                                     "rounds": 5, "within_noise": False, "iqr": [1.07, 1.12]},
                        "bf16_math": {"fix": "bf16_math", "speedup": 1.5, "baseline_ms": 10.0, "candidate_ms": 6.7,
                                      "rounds": 5, "within_noise": False, "iqr": [1.45, 1.55]}})
    found = run_rules(_obs(_set("env", {**CPU_ENV, "bf16_supported": True}), _set("model.autocast", False), v))
    fp32 = [f for f in found if f.rule in ("no-amp", "cpu-bf16-math")]
    assert [f.rule for f in fp32] == ["cpu-bf16-math"] and fp32[0].severity == "high"
    assert [a.rule for a in fp32[0].also] == ["no-amp"] and fp32[0].also[0].measured_gain == 1.1


def test_measurement_within_noise_is_low():
    v = _set("verify", {"channels_last": {"fix": "channels_last", "speedup": 1.4, "baseline_ms": 10.0,
                                          "candidate_ms": 7.1, "rounds": 5, "within_noise": True, "iqr": [0.8, 1.9]}})
    f = RULES["channels-last"].check(_obs(TRIGGERS["channels-last"][0], v))
    assert f.measured_gain == 1.4 and f.severity == "low" and "within noise" in f.evidence


def test_findings_are_ranked_by_severity_then_gain():
    obs = _obs(_workers0, *TRIGGERS["no-amp"], *TRIGGERS["small-batch"],
               *TRIGGERS["conv-bias-before-bn"], *TRIGGERS["eval-grad-enabled"])
    found = run_rules(obs)
    order = {"high": 0, "medium": 1, "low": 2}
    ranks = [order[f.severity] for f in found]
    assert ranks == sorted(ranks) and found[0].rule == "data-bound" and found[0].severity == "high"


def test_odd_sizes_include_a_language_models_vocabulary_but_not_a_classifiers_classes():
    import torch
    from torch import nn

    from torchspeed.doctor._capture import Captured
    from torchspeed.doctor._model_checks import examine_model

    class LM(nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.tok = nn.Embedding(vocab, 32)
            self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
            self.head = nn.Linear(32, vocab, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, idx):
            return self.head(self.mlp(self.tok(idx)))

    def odd(model, x):
        obs = {"notes": [], "env": {}}
        examine_model(Captured(model=model, args=(x,)), obs)
        return obs["model"]["odd_sizes"]

    ids = torch.randint(0, 997, (8, 16))
    assert odd(LM(997), ids) == ["head.out_features=997"]  # the LM head over an odd vocabulary
    assert odd(LM(1024), ids) == []
    classifier = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))  # 10 classes: not a choice
    assert odd(classifier, torch.randn(8, 32)) == []
    obs = _obs(_set("model.odd_sizes", ["head.out_features=997"]))
    assert "vocabulary" in RULES["size-not-multiple-of-8"].check(obs).fix


def test_optimizer_kernel_needs_a_fused_kernel_here_and_is_ranked_by_its_measurement():
    trig = TRIGGERS["optimizer-kernel"]
    f = RULES["optimizer-kernel"].check(_obs(*trig))
    assert f.patch == "fused_optimizer" and "fused=True" in f.fix and "10%" in f.evidence
    assert f.severity == "low" and "estimated, not measured" in f.evidence  # 10% x an assumed 1.5x: a model
    opt = copy.deepcopy(_obs(*trig)["optimizer"])  # (a fresh dict: TRIGGERS' own is shared)
    assert RULES["optimizer-kernel"].check(_obs(*trig, _set("optimizer", {**opt, "fused": True}))) is None
    assert RULES["optimizer-kernel"].check(_obs(*trig, _set("optimizer", {**opt, "fused_available": False}))) is None
    # unmeasured, a share whose estimate is under the minimum effect (4% x 1.5x: 1.01x) is no finding; 7% is
    for opt_ms, found in ((0.4, False), (0.7, True)):
        detail = _set("breakdown.compute_detail_ms", {"forward": 3.0, "backward": 5.0, "optimizer": opt_ms,
                                                      "zero_grad": 0.0})
        assert (RULES["optimizer-kernel"].check(_obs(*trig, detail)) is not None) == found
    # --verify timed the step with the fused kernel on the captured model and optimizer: 1.23x
    f = RULES["optimizer-kernel"].check(_obs(*trig, _verified("fused_optimizer", 1.23, (1.18, 1.27))))
    assert f.basis == "measured" and f.measured_gain == 1.23 and f.severity == "medium"
    assert "--verify measured 1.23x" in f.evidence


def test_sparse_momentum_names_the_growth_it_timed_and_needs_a_sparse_weight_with_momentum():
    """An SGD group with momentum over an embedding's sparse weight: the finding, with the optimizer's growth over
    the steps seen (0.5 -> 2.5 ms over a mean 10 ms step: 1 ms of it on average); none without such a weight. The count
    comes from the captured optimizer and model (`optimizer_info`): momentum 0 on the sparse weight, a dense
    embedding, or another optimizer class count none."""
    import torch
    from torch import nn

    from torchspeed.doctor._model_checks import optimizer_info

    f = RULES["sparse-momentum"].check(_obs(*TRIGGERS["sparse-momentum"]))
    assert f is not None and "0.50 ms" in f.evidence and "2.50 ms" in f.evidence and "'momentum': 0.0" in f.fix
    assert f.est_gain == pytest.approx(10.0 / 9.0, abs=1e-3)  # (rounded to 3 places)
    opt = {**_obs(*TRIGGERS["sparse-momentum"])["optimizer"], "sparse_momentum": 0}
    assert RULES["sparse-momentum"].check(_obs(*TRIGGERS["sparse-momentum"], _set("optimizer", opt))) is None

    def count(sparse, make):
        model = nn.Sequential(nn.EmbeddingBag(50, 8, sparse=sparse), nn.Linear(8, 2))
        return optimizer_info(make(model), model)["sparse_momentum"]
    assert count(True, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) == 1
    assert count(True, lambda m: torch.optim.SGD(m.parameters(), lr=0.1)) == 0
    assert count(True, lambda m: torch.optim.SGD([{"params": m[0].parameters(), "momentum": 0.0},
                                                  {"params": m[1].parameters()}], lr=0.1, momentum=0.9)) == 0
    assert count(False, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) == 0
    assert count(True, lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1)) == 0
    # --verify measured the fix (the sparse weight's momentum at 0) on the captured batch: the interval decides
    entry = {"fix": "sparse_momentum", "speedup": 1.6, "baseline_ms": 10.0, "candidate_ms": 6.25, "rounds": 5,
             "within_noise": False, "iqr": [1.45, 1.8]}
    f = RULES["sparse-momentum"].check(_obs(*TRIGGERS["sparse-momentum"], _set("verify", {"sparse_momentum": entry})))
    assert f.basis == "measured" and f.measured_gain == 1.6 and f.severity == "high"
    assert "--verify measured 1.60x" in f.evidence and "a lower bound" in f.evidence


def test_the_breakdown_times_the_optimizer_over_the_first_and_last_third_of_the_steps():
    from torchspeed.doctor._summary import _breakdown
    recs = [{"step": 10.0, "optim": float(i)} for i in range(9)]
    assert _breakdown(recs, recs, [], within_warmup=False)["optimizer_ms_thirds"] == [1.0, 7.0]
    assert _breakdown(recs[:2], recs[:2], [], within_warmup=False)["optimizer_ms_thirds"] is None


def test_layout_copies_near_their_line_are_listed_low_and_under_it_not_at_all():
    """A share that one profiled window puts just over the 10% line and the next just under it gives the same
    (rule, severity) both times: low, with what settles it; well under the line, no finding; over it, the finding
    without the near-the-line words (its severity the registry's, from the estimate)."""
    from torchspeed.doctor.rules import layout_copies

    def sev(share):
        found = [f for f in run_rules(_obs(_set("kernels.layout_share", share))) if f.rule == "layout-copies"]
        return found[0].severity if found else None
    assert sev(0.095) == sev(0.104) == "low"
    near = [f for f in run_rules(_obs(_set("kernels.layout_share", 0.095))) if f.rule == "layout-copies"][0]
    assert "near the 10% share" in near.evidence and "--verify" in near.evidence
    assert sev(layout_copies.NEAR * layout_copies.SHARE - 0.01) is None
    over = [f for f in run_rules(_obs(_set("kernels.layout_share", 0.3))) if f.rule == "layout-copies"][0]
    assert "near the" not in over.evidence

"""Every registered rule, on synthetic observations: it fires on its problem, stays quiet on a
clean observation, and its severity follows the cost on the device (and --verify's measurement).

The loop is over the registry, so a new rule file is covered once it has a TRIGGERS entry.
"""

import copy
from pathlib import Path

import pytest

from torchspeed.doctor import RULES, rule_ids, run_rules
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
    "elementwise-bound": [_set("kernels.elementwise_share", 0.55)],
    "compile-graph-breaks": [_set("compile.graph_breaks", [{"site": "train.py:12", "reason": "Data-dependent "
                                                            "branching", "count": 3}])],
    "debug-mode-on": [_set("debug.anomaly_detection", True)],
    "cpu-bf16-math": [_no_autocast_bf16_cpu],
    "allocator": [_set("breakdown.minor_faults_per_step", 6000.0)],
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
    assert set(d) == {"rule", "severity", "evidence", "fix", "est_gain", "measured_gain", "patch"}
    assert d["est_gain"] is None or isinstance(d["est_gain"], float)
    assert RULES[rule_id].check(_obs()) is None  # and only there


def test_host_sync_severity_follows_the_device():
    sync = TRIGGERS["host-sync"][0]
    assert RULES["host-sync"].check(_obs(sync)).severity == "low"
    assert RULES["host-sync"].check(_obs(sync, _cuda)).severity == "medium"
    many = _set("syncs.calls_per_step", 8.0)
    assert RULES["host-sync"].check(_obs(sync, many, _cuda)).severity == "high"


def test_no_amp_follows_what_the_machine_runs_fast():
    no_amp = TRIGGERS["no-amp"][0]
    f = RULES["no-amp"].check(_obs(no_amp))
    assert f.severity == "low" and f.est_gain < 1 and f.fix.startswith("keep fp32")
    bf16_cpu = _set("env", {**CPU_ENV, "bf16_supported": True})
    f = RULES["no-amp"].check(_obs(no_amp, bf16_cpu))
    assert f.est_gain > 1.25 and f.severity == "high" and "torch.autocast('cpu'" in f.fix
    f = RULES["no-amp"].check(_obs(no_amp, _cuda))
    assert f.severity == "high" and "torch.autocast('cuda'" in f.fix


def test_measured_gain_overrides_the_estimate():
    no_amp = TRIGGERS["no-amp"][0]
    for speedup in (0.45, 1.1, 1.6):
        v = _set("verify", {"autocast": {"fix": "autocast", "speedup": speedup, "baseline_ms": 10.0,
                                         "candidate_ms": 10.0 / speedup, "rounds": 5, "within_noise": False,
                                         "iqr": [speedup * 0.95, speedup * 1.05]}})
        f = RULES["no-amp"].check(_obs(no_amp, _set("env", {**CPU_ENV, "bf16_supported": True}), v))
        assert f.measured_gain == speedup and f.severity == severity_for_gain(speedup)
        assert "--verify measured" in f.evidence
        if speedup < 1:
            assert "slow-down" in f.evidence and f.fix.startswith("keep fp32")


def test_measurement_within_noise_is_low():
    v = _set("verify", {"channels_last": {"fix": "channels_last", "speedup": 1.4, "baseline_ms": 10.0,
                                          "candidate_ms": 7.1, "rounds": 5, "within_noise": True, "iqr": [0.8, 1.9]}})
    f = RULES["channels-last"].check(_obs(TRIGGERS["channels-last"][0], v))
    assert f.measured_gain == 1.4 and f.severity == "low" and "within noise" in f.evidence


def test_findings_are_ranked_by_severity_then_gain():
    obs = _obs(*TRIGGERS["data-bound"], *TRIGGERS["no-amp"], *TRIGGERS["small-batch"],
               *TRIGGERS["conv-bias-before-bn"], *TRIGGERS["eval-grad-enabled"])
    found = run_rules(obs)
    order = {"high": 0, "medium": 1, "low": 2}
    ranks = [order[f.severity] for f in found]
    assert ranks == sorted(ranks) and found[0].rule == "data-bound"


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

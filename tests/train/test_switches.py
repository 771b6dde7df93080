"""Every automatic switch measured on the run's own first steps (train/trial/switches.py, train/trial/autoswitch.py).

The decisions are tested with injected device capabilities and injected measurements: nothing
here depends on this machine's CPU, its load or the wall clock.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train.trial.autoswitch import SwitchStage
from torchspeed.env import DeviceCaps
from torchspeed.train.decision import Decision, TrialCache
from torchspeed.train.trial.precision import resolve_precision
from torchspeed.train.rounds import faster_beyond_chance, share_faster
from torchspeed.train.trial.switch_choice import (Switches, candidate_grid, choose, numerics_ok, prior_first,
                                                  rule_switches)

AVX2 = DeviceCaps("cpu", cpu_bf16=False, cores=2)
BF16_CPU = DeviceCaps("cpu", cpu_bf16=True, cores=2)
SM80 = DeviceCaps("cuda", cuda_capability=(8, 0))
SM70 = DeviceCaps("cuda", cuda_capability=(7, 0))


def _loader(n=64, batch=16, size=8, classes=4):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(1))


def test_candidates_are_a_pure_function_of_the_capabilities():
    labels = lambda caps, conv: [s.label() for s in candidate_grid(caps=caps, has_conv=conv)]  # noqa: E731
    assert labels(AVX2, True) == ["fp32", "fp32+channels_last"]  # emulated bf16 is never tried
    assert labels(BF16_CPU, True) == ["fp32", "fp32+channels_last", "bf16", "bf16+channels_last"]
    assert labels(BF16_CPU, False) == ["fp32", "bf16"]  # no convolutions: no layout to choose
    assert labels(SM80, False) == ["fp32", "bf16"]
    assert labels(SM70, False) == ["fp32", "fp16"]
    assert [s.label() for s in candidate_grid(caps=BF16_CPU, has_conv=True, precision="fp32")] == \
        ["fp32", "fp32+channels_last"]  # a precision the user fixed is not searched


def test_rules_prior_by_capability_including_cuda():
    assert resolve_precision("auto", device="cpu", caps=AVX2).name == "fp32"
    assert resolve_precision("auto", device="cpu", caps=BF16_CPU).name == "bf16"
    p70 = resolve_precision("auto", device="cpu", caps=SM70)
    assert p70.name == "fp16" and p70.needs_scaler and p70.device_type == "cuda"
    p80 = resolve_precision("auto", device="cpu", caps=SM80)
    assert p80.name == "bf16" and not p80.needs_scaler


def test_choose_takes_the_fastest_but_not_a_change_within_noise():
    plain = Switches("fp32", False)
    t = {plain: [1.0, 1.0], Switches("fp32", True): [0.8, 0.8], Switches("bf16", True): [1.3, 1.2]}
    assert choose(t, plain=plain)[0] == Switches("fp32", True)
    t[Switches("fp32", True)] = [0.99, 0.99]  # 1% faster: within min_gain, keep the plain settings
    pick, why = choose(t, plain=plain)
    assert pick == plain and "not worth a change" in why
    assert choose(t, plain=plain, rejected={plain: "x"})[0] == Switches("fp32", True)


def test_a_change_must_win_most_pairings_of_its_timed_steps_not_only_the_median():
    """A median 5% faster whose steps lose to a third of the plain settings' (the faster in 67% of the pairings)
    keeps the plain settings; the same median from steps that beat 5 of the plain's 6 is taken."""
    plain, cl = Switches("fp32", False), Switches("fp32", True)
    pick, why = choose({plain: [0.9, 1.05, 1.05, 0.9, 1.05, 1.05], cl: [1.0] * 6}, plain=plain)
    assert pick == plain and "1.05x" in why and "66.7% of the pairings" in why and "not sure enough" in why
    assert choose({plain: [0.99, 1.05, 1.05, 1.05, 1.05, 1.05], cl: [1.0] * 6}, plain=plain)[0] == cl
    assert share_faster([1.0], [1.0]) == 0.5 and share_faster([0.9, 1.1], [1.0]) == 0.5


def test_over_many_timed_steps_a_change_faster_beyond_chance_is_sure_though_it_wins_fewer_pairings():
    """Steps that vary by a third, channels_last 1.18x faster on each: it wins 72% of the pairings however many steps
    are timed. On 6 steps a side that is not sure (kept plain); on 18 a side (a choice pooled over three runs) the
    rank test says it is faster beyond chance (p ~ 0.01), and it is taken. Breaks if the share alone decides."""
    plain, cl = Switches("fp32", False), Switches("fp32", True)
    steps = [1.0, 1.25, 0.8, 1.1, 0.9, 1.35]
    faster = [round(x * 0.85, 4) for x in steps]
    assert share_faster(faster * 3, steps * 3) == share_faster(faster, steps) == pytest.approx(0.722, abs=1e-3)
    pick, why = choose({plain: steps, cl: faster}, plain=plain)
    assert pick == plain and "72.2% of the pairings" in why and "not beyond chance" in why
    assert choose({plain: steps * 3, cl: faster * 3}, plain=plain)[0] == cl
    assert faster_beyond_chance(faster * 3, steps * 3) and not faster_beyond_chance(steps * 3, faster * 3)
    assert not faster_beyond_chance(steps * 3, steps * 3) and not faster_beyond_chance([0.5] * 3, [1.0] * 3)


def test_another_precision_must_buy_ten_percent_a_layout_the_usual_two():
    """bf16 sure but 5% faster keeps fp32 (it moves the run's results; a layout 5% faster is taken as before);
    bf16 20% faster is taken. Breaks if the precision threshold goes."""
    plain, bf16, cl = Switches("fp32", False), Switches("bf16", False), Switches("fp32", True)
    pick, why = choose({plain: [1.0] * 6, bf16: [0.95] * 6}, plain=plain)
    assert pick == plain and "1.05x" in why and "another precision" in why
    assert choose({plain: [1.0] * 6, cl: [0.95] * 6}, plain=plain)[0] == cl
    assert choose({plain: [1.0] * 6, bf16: [0.8] * 6}, plain=plain)[0] == bf16
    # a 5%-faster bf16 out, a 3%-faster layout still in: the layout, not the precision
    assert choose({plain: [1.0] * 6, bf16: [0.95] * 6, cl: [0.97] * 6}, plain=plain)[0] == cl


def test_numerics_guard():
    assert numerics_ok(2.30, 2.31, tol=0.05)
    assert not numerics_ok(2.30, 3.0, tol=0.05)
    assert not numerics_ok(2.30, float("nan"), tol=0.05)


def _trainer(model, caps, *, seconds=None, optimizer=None, lr=0.05, **cfg):
    """A Trainer with injected capabilities and, when `seconds` is given, injected step times per candidate label."""
    from torchspeed.train.config import TrainConfig
    from torchspeed.train.loop.trainer import Trainer

    kw = dict(epochs=1, progress=False, compile=False, trial=True, fused_optimizer=False) | cfg
    t = Trainer(model, optimizer=optimizer if optimizer is not None else "sgd", lr=lr, config=TrainConfig(**kw),
                caps=caps)
    if seconds is not None:
        calls = []
        def measure(s, sec):  # labels without "+foreach" stand for the foreach kernel the trainer built
            calls.append(s.label())
            return seconds[s.label()] if s.label() in seconds else seconds[s.label().replace("+foreach", "")]
        t.switcher.measure_fn = measure
        t.calls = calls
    return t


def test_bf16_cpu_where_bf16_loses_keeps_fp32(tiny_cnn):
    seconds = {"fp32+fused": 1.0, "fp32+channels_last+fused": 0.9, "bf16+fused": 1.1,
               "bf16+channels_last+fused": 1.3, "fp32+channels_last+foreach": 0.95}  # all within DROP_AT
    t = _trainer(tiny_cnn(), BF16_CPU, seconds=seconds, fused_optimizer="auto")
    t.switcher.race = False  # constant injected seconds: every slower candidate would be beaten on round 1
    res = t.fit(_loader(n=16 * 200))  # long enough for the full trial
    d = res.decisions
    assert t.switcher.current() == Switches("fp32", True, True, t.switcher.current().threads)
    assert isinstance(d["precision"], Decision) and d["precision"].value == "fp32"
    assert d["channels_last"].value is True and d["fused_optimizer"].value is True
    assert d["switch_trial"].value == "measured" and d["switch_trial"].measured["stages"][0]["chosen"] == \
        "fp32+channels_last+fused"
    from torchspeed.train.trial.trial_size import TRIAL_SETTINGS
    per = TRIAL_SETTINGS["warmup"] + TRIAL_SETTINGS["rounds"] * TRIAL_SETTINGS["steps"]
    assert t.calls.count("bf16+channels_last+fused") == per  # warm-up, then interleaved rounds of timed steps
    assert t.calls.index("bf16+fused") < t.calls.index("fp32+channels_last+fused", 4)  # interleaved, not in blocks


def test_a_long_shot_leaves_the_trial_after_its_first_timed_step():
    """A candidate DROP_AT x slower than the fastest after round 1 takes no later turns (each would cost the run a
    slow step); one within DROP_AT stays for every round; the choice and the record are unchanged otherwise."""
    from torchspeed.train.trial.switches import DROP_AT, LiveTrial

    grid = candidate_grid(caps=BF16_CPU, has_conv=True)  # fp32, fp32+cl, bf16, bf16+cl
    secs = {"fp32": 2.0, "fp32+channels_last": 1.3, "bf16": 2.2, "bf16+channels_last": 1.0}
    assert secs["fp32"] > DROP_AT * secs["bf16+channels_last"] > secs["fp32+channels_last"]
    trial, taken = LiveTrial(grid, rounds=3, steps=2, warmup=1, race=False), []  # constant seconds: no race
    while not trial.done:
        s = trial.current()
        taken.append(s.label())
        trial.record(secs[s.label()])
    assert taken.count("fp32") == taken.count("bf16") == 1 + 2  # warm-up + its first round's two timed steps
    assert taken.count("fp32+channels_last") == taken.count("bf16+channels_last") == 1 + 3 * 2
    assert trial.steps_run == len(taken) == 6 + 14 and trial.best == Switches("bf16", True)
    assert set(trial.report["dropped"]) == {"fp32", "bf16"}


def test_a_candidate_beaten_on_every_timed_step_leaves_the_later_rounds():
    """Once each candidate has two timed steps, one whose fastest is slower than every step of the fastest leaves
    the later rounds; one whose steps overlap the fastest's stays for every round; the choice is the same."""
    from torchspeed.train.trial.switches import LiveTrial

    grid = candidate_grid(caps=BF16_CPU, has_conv=True)  # fp32, fp32+cl, bf16, bf16+cl
    secs = {"fp32": [1.0, 1.2], "fp32+channels_last": [0.9, 1.1], "bf16": [1.25, 1.3],
            "bf16+channels_last": [1.15, 0.95]}
    for race in (True, False):
        trial, taken = LiveTrial(grid, rounds=3, steps=2, warmup=1, race=race), []
        while not trial.done:
            s = trial.current().label()
            trial.record(secs[s][taken.count(s) % 2])
            taken.append(s)
        assert trial.best == Switches("fp32", True)  # the fastest by median either way
        if race:  # bf16 (1.25 at best) is slower than each of fp32+cl's steps (1.1 at worst): out after round 1
            assert taken.count("bf16") == 1 + 2 and "bf16" in trial.report["dropped"]
            assert taken.count("fp32") == taken.count("bf16+channels_last") == 1 + 3 * 2  # overlapping: kept
            assert set(trial.report["dropped"]) == {"bf16"}
        else:
            assert taken.count("bf16") == 1 + 3 * 2 and "dropped" not in trial.report


def test_the_plain_settings_leave_the_race_only_to_a_candidate_ahead_by_ahead():
    """Two timed steps each, every one of the plain settings' slower than every one of channels_last's: at a 2%
    lead (noise can do that, and their leaving decides a change) the plain settings take every round, and their
    later steps keep them; at a 30% lead (AHEAD: 10%) they leave after round 1."""
    from torchspeed.train.trial.switches import LiveTrial

    grid = candidate_grid(caps=AVX2, has_conv=True)  # fp32, fp32+channels_last
    for cl, rounds_plain in ((0.98, 1 + 3 * 2), (0.7, 1 + 2)):
        trial, taken = LiveTrial(grid, rounds=3, steps=2, warmup=1), []
        while not trial.done:
            s = trial.current().label()
            n = taken.count(s)
            taken.append(s)
            trial.record({"fp32": [1.0, 1.0, 1.0, 0.97, 0.97, 0.97, 0.97], "fp32+channels_last": [cl] * 7}[s][n])
        assert taken.count("fp32") == rounds_plain, cl
        assert trial.best == (Switches("fp32", False) if cl == 0.98 else Switches("fp32", True))


def test_the_measuring_cost_counts_warm_up_steps_but_not_the_runs_start_up():
    """extra_seconds: every trial step above the winner's median, the warm-up steps (a switch of settings and its
    first step's one-off work) included; the run's first step only up to its candidate's own median, since
    any run pays its start-up once."""
    from torchspeed.train.trial.switches import LiveTrial

    grid = candidate_grid(caps=BF16_CPU, has_conv=False)  # fp32, bf16
    trial = LiveTrial(grid, rounds=1, steps=1, warmup=1)
    warm_up = {"fp32": 5.0, "bf16": 0.7}  # the run's start-up lands on fp32's
    timed, seen = {"fp32": 1.0, "bf16": 0.5}, set()
    while not trial.done:
        s = trial.current().label()
        trial.record((timed if s in seen else warm_up)[s])
        seen.add(s)
    assert trial.best == Switches("bf16", False) and trial.steps_run == 4
    # timed: fp32 0.5 over; warm-ups: fp32 capped at its median 1.0 (0.5 over), bf16 0.7 (0.2 over)
    assert trial.extra_seconds() == pytest.approx(0.5 + 0.5 + 0.2)


def test_the_long_shot_cut_is_measured_from_a_candidate_the_numerics_guard_allows():
    """The fastest candidate moves the loss: the others are judged against the fastest allowed one, so the
    plain settings are not dropped for being slower than a candidate that cannot be taken."""
    from torchspeed.train.trial.switches import LiveTrial

    grid = candidate_grid(caps=BF16_CPU, has_conv=False)  # fp32, bf16
    trial = LiveTrial(grid, rounds=3, steps=1, warmup=1, losses={"fp32": 2.3, "bf16": 2.9})
    taken = []
    while not trial.done:
        s = trial.current()
        taken.append(s.label())
        trial.record({"fp32": 1.0, "bf16": 0.4}[s.label()])
    assert taken.count("fp32") == 4 and "dropped" not in trial.report
    assert trial.best == Switches("fp32", False) and "bf16" in trial.report["rejected"]


def test_a_candidate_the_numerics_guard_refuses_never_leads():
    """bf16 measures 2.5x faster but moves the loss 26%: it never counts as ahead, so its turns stay timed apart
    (a refused precision must not train the run's steps); allowed, the same times lead after its first look. Where
    channels_last leads, the run's other turns train, but not a refused precision's."""
    from torchspeed.train.trial.switches import LiveTrial

    grid = candidate_grid(caps=BF16_CPU, has_conv=False)  # fp32, bf16
    for bf16_loss, leads in ((2.9, False), (2.31, True)):
        trial, ahead = LiveTrial(grid, rounds=3, steps=1, warmup=1, losses={"fp32": 2.3, "bf16": bf16_loss}), []
        while not trial.done:
            trial.record({"fp32": 1.0, "bf16": 0.4}[trial.current().label()])
            ahead.append(trial.ahead_of_plain())
        assert any(ahead) is leads
    grid = candidate_grid(caps=BF16_CPU, has_conv=True)  # channels_last leads: its turns train, a refused bf16's not
    trial = LiveTrial(grid, rounds=3, steps=1, warmup=1, losses={"fp32": 2.3, "bf16": 2.9})
    while not all(trial.times.values()):
        trial.record({"fp32": 1.0, "fp32+channels_last": 0.7, "bf16": 0.5, "bf16+channels_last": 0.4}[
            trial.current().label()])
    assert trial.ahead_of_plain() and trial.ahead_of_plain(Switches("fp32", True))
    assert not trial.ahead_of_plain(Switches("bf16", False)) and not trial.ahead_of_plain(Switches("bf16", True))


def test_a_half_precision_that_moves_the_loss_is_not_taken(tiny_cnn, monkeypatch):
    from torchspeed.train.loop.trainer import Trainer

    monkeypatch.setattr(SwitchStage, "_numerics_losses", lambda self, batch: {"fp32": 2.3, "bf16": 2.9})
    t = _trainer(tiny_cnn(), BF16_CPU, seconds={"fp32": 1.0, "fp32+channels_last": 1.0, "bf16": 0.5,
                                                "bf16+channels_last": 0.5})
    res = t.fit(_loader(n=320))
    assert res.decisions["precision"].value == "fp32" and "bf16+foreach" in res.decisions["switch_trial"].measured["rejected"]


def test_cuda_sm80_device_decision_is_measured_too(tiny_cnn):
    t = _trainer(tiny_cnn(), SM80, seconds={"fp32": 2.0, "bf16": 1.0}, channels_last=False)
    t.device = torch.device("cpu")  # the decision is a function of the injected capabilities; the steps run here
    res = t.fit(_loader(n=320))
    assert res.decisions["precision"].value == "bf16" and "2.00x" in res.decisions["precision"].reason


def test_the_trial_steps_are_the_runs_own_steps(tiny_cnn):
    """Every measured step trains: the run takes exactly its steps, and the measured ones are among them."""
    t = _trainer(tiny_cnn(), AVX2, seconds={"fp32": 1.0, "fp32+channels_last": 0.5})
    res = t.fit(_loader(n=640))  # 40 steps
    trial = res.decisions["switch_trial"]
    assert res.steps == 40 and trial.value == "measured" and 0 < trial.measured["steps"] <= res.steps
    assert res.decisions["channels_last"].value is True and t.channels_last
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in t.module.parameters() if p.dim() == 4)
    state = [v for st in t.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() == 4]
    assert state and all(v.is_contiguous(memory_format=torch.channels_last) for v in state)  # the state followed


def _record_input_layouts(t):
    """(trial over?, model in channels_last?, input in channels_last?) at each training forward of `t`'s conv."""
    conv, seen = t.module[0], []

    def hook(_m, args):
        if torch.is_grad_enabled():  # training steps only, not the trial's no-grad numerics check
            seen.append((t.switcher.live is None, t.channels_last,
                         args[0].is_contiguous(memory_format=torch.channels_last)))
    conv.register_forward_pre_hook(hook)
    return seen


@pytest.mark.parametrize("prefetch", [True, False])
def test_after_the_trial_the_inputs_follow_the_layout_it_chose(tiny_cnn, prefetch):
    """The rule's prior is bf16 + channels_last here; the trial measures plain fp32 fastest. The rest of the
    epoch's inputs must then be NCHW too: a channels_last input would run every convolution channels_last."""
    t = _trainer(tiny_cnn(), BF16_CPU, seconds={"fp32": 0.5, "fp32+channels_last": 1.0, "bf16": 1.0,
                                                "bf16+channels_last": 1.0}, prefetch=prefetch)
    assert t.layout_pending and t.channels_last is False  # the rules' prior, left to the trial (not copied to)
    seen = _record_input_layouts(t)
    res = t.fit(_loader(n=16 * 40))
    assert res.decisions["channels_last"].value is False
    after = [s for s in seen if s[0]]
    assert len(after) >= 10 and all(model_cl is False and input_cl is False for _, model_cl, input_cl in after)
    during = [s for s in seen if not s[0]]
    assert all(model_cl == input_cl for _, model_cl, input_cl in during)  # each candidate got its own layout


def test_a_cache_hit_lays_out_the_inputs_from_the_first_step(tiny_cnn, monkeypatch):
    """A cached trial that chose NCHW, under a channels_last prior: every step's input is NCHW (no step measured)."""
    hit = {"switches": {"precision": "fp32", "channels_last": False, "fused": None, "threads": None}, "steps": 9,
           "stages": [], "extra_s": 0.1}
    monkeypatch.setattr(TrialCache, "get", lambda self, key: hit)
    t = _trainer(tiny_cnn(), BF16_CPU)
    seen = _record_input_layouts(t)
    res = t.fit(_loader(n=16 * 6))
    assert res.decisions["switch_trial"].value == "cached"
    assert len(seen) == 6 and all(s == (True, False, False) for s in seen)


def test_a_short_run_measures_what_it_can_afford_and_says_so(tiny_cnn):
    t = _trainer(tiny_cnn(), BF16_CPU, seconds={"fp32": 1.0, "fp32+channels_last": 0.8, "bf16": 1.2,
                                                "bf16+channels_last": 0.9})
    res = t.fit(_loader(n=192))  # a 12-step run
    trial = res.decisions["switch_trial"]
    assert trial.value == "measured" and "affords 1 round" in trial.reason
    assert res.steps == 12 and res.decisions["channels_last"].value is True and res.decisions["precision"].value == "fp32"
    assert trial.measured["steps"] == 8  # a warm-up and one timed step each
    t2 = _trainer(tiny_cnn(), BF16_CPU, seconds={"fp32": 1.0, "fp32+channels_last": 0.8, "bf16": 1.2,
                                                 "bf16+channels_last": 0.9})
    res2 = t2.fit(_loader(n=48))  # 3 steps: fewer than the candidates; decided on what was measured
    assert res2.steps == 3 and res2.decisions["switch_trial"].value == "measured"
    assert res2.decisions["switch_trial"].measured["steps"] == 3  # (unpriced here: conftest)


def test_the_rules_choice_is_tried_first():
    """After the plain settings, the rules' own choice, then by how few switches differ from it (pure function)."""
    def order(caps, conv):
        grid = candidate_grid(caps=caps, has_conv=conv)
        return [s.label() for s in prior_first(grid, rule_switches(caps=caps, has_conv=conv))]
    assert order(BF16_CPU, True) == ["fp32", "bf16+channels_last", "fp32+channels_last", "bf16"]
    assert order(AVX2, True) == ["fp32", "fp32+channels_last"]
    assert order(BF16_CPU, False) == ["fp32", "bf16"]


@pytest.mark.priced
def test_a_run_that_affords_one_setting_tries_the_rules_choice(tiny_cnn):
    """A 60-step run of 10 ms steps at a 3% share (0.018 s) affords one switch (its first step 0.02 s, a step's
    worth at least), not three: it tries bf16 + channels_last, the rules' choice, takes it where it measures faster,
    and says which settings it left untried and why."""
    t = _trainer(tiny_cnn(), BF16_CPU, trial_share=0.03)
    t.switcher.keep_numerics = False  # every turn trains: only the price decides what is tried
    _cold_first_steps(t, 0.02, {"fp32": 0.010, "fp32+channels_last": 0.0095, "bf16": 0.0098,
                                "bf16+channels_last": 0.006}, warm_plain=True)
    res = t.fit(_loader(n=16 * 60))
    trial = res.decisions["switch_trial"]
    assert "stopped" not in trial.measured
    assert sorted(trial.measured["untried"]) == ["bf16+foreach", "fp32+channels_last+foreach"]
    assert res.decisions["precision"].value == "bf16" and res.decisions["channels_last"].value is True
    assert "not tried" in res.decisions["precision"].reason


def test_a_cached_trial_that_left_settings_untried_is_measured_again_by_a_longer_run(tiny_cnn, monkeypatch):
    """A partial trial's entry settles runs as long as the one that measured it; a longer run, which may afford the
    settings it left untried, measures again."""
    hit = {"switches": {"precision": "fp32", "channels_last": False, "fused": None, "threads": None}, "steps": 9,
           "rounds": 3, "steps_per_round": 2, "stages": [], "extra_s": 0.1, "run_steps": 50,
           "untried": {"bf16": "not tried"}}
    monkeypatch.setattr(TrialCache, "get", lambda self, key: hit)
    monkeypatch.setattr(TrialCache, "put", lambda self, key, report: None)
    short = _trainer(tiny_cnn(), BF16_CPU).fit(_loader(n=16 * 50))
    longer = _trainer(tiny_cnn(), BF16_CPU).fit(_loader(n=16 * 80))
    assert short.decisions["switch_trial"].value == "cached"
    assert longer.decisions["switch_trial"].value == "measured"


def _cold_first_steps(trainer, cold_s: float, steady: dict, *, warm_plain: bool = False) -> None:
    """Injected seconds: each candidate's first step `cold_s` (a switch's one-off work: kernels, cuDNN's autotuning,
    oneDNN's primitives), its later steps `steady[label]`. `warm_plain`: the plain settings ran in this process
    before (a second run), so their first step costs a steady one."""
    seen = {"fp32"} if warm_plain else set()

    def measure(s, sec):
        label = s.label().replace("+foreach", "")  # the kernel the trainer built (fused_optimizer=False)
        first = label not in seen
        seen.add(label)
        return cold_s if first else steady[label]
    trainer.switcher.measure_fn = measure


STEADY = {"fp32": 0.010, "fp32+channels_last": 0.008, "bf16": 0.012, "bf16+channels_last": 0.009}


@pytest.mark.priced
def test_a_trial_that_would_cost_more_than_a_short_run_can_win_keeps_the_plain_settings(tiny_cnn):
    """The digits on a fresh H200: 3.6 s of measuring on a 96-step run of 10 ms steps. Here a switch's first step
    costs 0.5 s and the 12-step run takes ~0.12 s: the trial stops after the plain settings' warm-up and one timed
    step, and the run keeps them."""
    t = _trainer(tiny_cnn(), BF16_CPU)
    _cold_first_steps(t, 0.5, STEADY)
    res = t.fit(_loader(n=16 * 12))
    trial = res.decisions["switch_trial"]
    assert res.steps == 12 and trial.value == "measured" and trial.measured["steps"] == 2
    assert "not measured: 3 other setting(s)" in trial.measured["stopped"]
    assert res.decisions["precision"].value == "fp32" and res.decisions["channels_last"].value is False
    assert "kept the plain settings" in res.decisions["precision"].reason


@pytest.mark.priced
def test_in_a_warm_process_the_first_dear_switch_leaves_the_rest_untried(tiny_cnn):
    """A second run in one process (the H200's second seed): the plain settings' first step is cheap, so their
    price lets the trial start with the rules' choice (bf16 + channels_last, first in the grid's order), but its
    first step costs 0.5 s. The rest is priced at that: the other two settings are not tried, and the one already
    paid for is measured to the end (its later steps train at its steady pace)."""
    t = _trainer(tiny_cnn(), BF16_CPU)
    tried = []
    measure = None

    def spy(s, sec):
        tried.append(s.label().replace("+foreach", ""))
        return measure(s, sec)
    _cold_first_steps(t, 0.5, STEADY, warm_plain=True)
    measure, t.switcher.measure_fn = t.switcher.measure_fn, spy
    res = t.fit(_loader(n=16 * 30))  # 3 switches and 3 passes timed apart: 6 steps, within 25% of 30
    trial = res.decisions["switch_trial"]
    assert res.steps == 30 and "stopped" not in trial.measured
    assert set(tried) == {"fp32", "bf16+channels_last"} and tried[2] == "bf16+channels_last"
    assert sorted(trial.measured["untried"]) == ["bf16+foreach", "fp32+channels_last+foreach"]
    assert "not tried" in res.decisions["precision"].reason


@pytest.mark.priced
@pytest.mark.parametrize("cold_s, n_batches, calls", [(0.5, 12, 0), (0.05, 200, 1)])
def test_the_numerics_guard_is_paid_only_by_a_trial_that_tries_another_precision(tiny_cnn, monkeypatch, cold_s,
                                                                                 n_batches, calls):
    """The guard's forward in every precision (on a GPU, cuDNN's autotuning for each one, cold) runs before the first
    other precision trains, not before the trial: a trial its price stops at once never pays it."""
    seen = []
    real = SwitchStage._numerics_losses
    monkeypatch.setattr(SwitchStage, "_numerics_losses",
                        lambda self, batch: seen.append(self.live.current().precision) or real(self, batch))
    t = _trainer(tiny_cnn(), BF16_CPU)
    _cold_first_steps(t, cold_s, STEADY)
    res = t.fit(_loader(n=16 * n_batches))
    assert len(seen) == calls and set(seen) <= {"bf16"}  # once, just before the first bf16 step
    assert ("stopped" in res.decisions["switch_trial"].measured) is (calls == 0)
    if calls:
        assert set(res.decisions["switch_trial"].measured["losses"]) == {"fp32", "bf16"}


@pytest.mark.priced
def test_a_run_long_enough_to_pay_for_the_trial_measures_every_setting(tiny_cnn):
    t = _trainer(tiny_cnn(), BF16_CPU)
    _cold_first_steps(t, 0.05, STEADY)  # 3 x 0.04 s to try the others, under a quarter of 200 x 10 ms
    res = t.fit(_loader(n=16 * 200))
    trial = res.decisions["switch_trial"]
    assert "stopped" not in trial.measured and trial.measured["steps"] > 8
    assert res.decisions["channels_last"].value is True and res.decisions["precision"].value == "fp32"


def test_a_short_runs_cached_trial_is_measured_again_by_a_run_that_affords_more(tiny_cnn, tmp_path, monkeypatch):
    """The cache is read by runs that afford no more than it measured (0 steps); a longer run measures again, once,
    and a short run then reads the deeper entry."""
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    counts = []

    def run(n_batches):  # real timings (an injected clock bypasses the cache): only step counts are asserted
        res = _trainer(tiny_cnn(), BF16_CPU).fit(_loader(n=16 * n_batches))
        counts.append(res.decisions["switch_trial"].measured["steps"])
        return res

    run(12)   # short: one timed step each (after its warm-up), cached
    run(12)   # as short: reads it
    run(200)  # affords the full trial: measures again
    run(12)   # reads the deeper entry
    assert counts[0] == 8 and counts[1] == 0 and counts[2] > 8 and counts[3] == 0


def test_the_trial_leaves_rng_and_data_order_as_without_it(tiny_cnn):
    """Nothing is read from the loader that the run does not train on: same batches, same global RNG."""
    seen = {}
    for trial in (True, False):
        t = _trainer(tiny_cnn(), AVX2, trial=trial)
        order = []
        loader = _loader()
        real = t.step_batch
        t.step_batch = lambda b, real=real, order=order: order.append(b[1].tolist()) or real(b)
        torch.manual_seed(5)
        t.fit(loader)
        seen[trial] = (order, torch.get_rng_state(), loader.generator.get_state())
    assert seen[True][0] == seen[False][0]
    assert torch.equal(seen[True][1], seen[False][1]) and torch.equal(seen[True][2], seen[False][2])


def test_a_trial_that_keeps_fp32_trains_the_run_the_fp32_loop_trains():
    """A candidate in another precision is timed apart (its forward and backward, then the RNG, BatchNorm's
    statistics and the gradients put back) and the batch trains in fp32: a run that keeps fp32 ends with the weights,
    running statistics and RNG of the run with no trial, to the last bit (dropout, BatchNorm, spectral norm)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(8, 32)), nn.BatchNorm1d(32), nn.ReLU(),
                             nn.Dropout(0.2), nn.Linear(32, 4))  # buffers a forward moves: BN's, spectral norm's

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(640, 8, generator=g), torch.randint(0, 4, (640,), generator=g)
    out = {}
    for trial in (True, False):
        cfg = {"trial": True} if trial else {"trial": False, "precision": "fp32"}
        t = _trainer(model(), BF16_CPU, seconds={"fp32": 1.0, "bf16": 1.3} if trial else None, **cfg)
        t.switcher.race = False  # every bf16 turn taken (constant seconds would end them after round 1)
        torch.manual_seed(3)
        res = t.fit(DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
        out[trial] = (t.module.state_dict(), torch.get_rng_state(), res)
    assert out[True][2].decisions["precision"].value == "fp32" and out[True][2].steps == out[False][2].steps == 40
    for k, v in out[False][0].items():
        assert torch.equal(out[True][0][k], v), k
    assert torch.equal(out[True][1], out[False][1])
    assert out[True][2].decisions["switch_trial"].measured["shadow_steps"] >= 4  # bf16's turns, timed apart


def _with_and_without_trial(build, loader, caps, *, trial: dict, plain: dict, prepare=None):
    """The same run twice, from `build()` with torch seeded 3 before `fit(loader())`: with the trial (`trial`: the
    Trainer's keywords, `seconds` among them; `prepare(trainer)` before it) and without (`plain`). Asserts the two end
    with the same weights and buffers to the last bit; returns (the trial run's result, the plain run's)."""
    out = {}
    for with_trial in (True, False):
        t = _trainer(build(), caps, **(trial if with_trial else plain))
        if with_trial and prepare is not None:
            prepare(t)
        torch.manual_seed(3)
        res = t.fit(loader())
        out[with_trial] = (t.module.state_dict(), res)
    for k, v in out[False][0].items():
        assert torch.equal(out[True][0][k], v), k
    return out[True][1], out[False][1]


def test_a_trial_that_keeps_the_plain_layout_trains_the_run_the_plain_loop_trains(tiny_cnn):
    """channels_last rounds otherwise too (its convolutions sum in another order): its turns are timed apart like
    another precision's, so a conv net whose trial keeps the plain layout ends with the weights and BatchNorm
    statistics of the run with no trial, to the last bit, and the trial says so."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(1600, 3, 8, 8, generator=g), torch.randint(0, 4, (1600,), generator=g)  # 100 steps: a full trial
    # race off: every channels_last turn taken (constant seconds would end them after round 1)
    res, plain = _with_and_without_trial(
        tiny_cnn, lambda: DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), AVX2,
        trial={"trial": True, "seconds": {"fp32": 1.0, "fp32+channels_last": 1.3}},
        plain={"trial": False, "channels_last": False}, prepare=lambda t: setattr(t.switcher, "race", False))
    d = res.decisions
    assert d["channels_last"].value is False and res.steps == plain.steps == 100
    assert d["switch_trial"].measured["shadow_steps"] == 7  # channels_last's warm-up and 3 rounds x 2 turns
    assert "in the plain settings' precision and layout" in d["switch_trial"].reason


def test_a_short_run_takes_no_more_turns_timed_apart_than_its_share(tiny_cnn, monkeypatch):
    """Each turn timed apart is a forward and backward thrown away: a run of known length takes, beyond the first
    look (the warm-up and one timed turn), at most SHADOW_SHARE of its steps of them, and decides on those."""
    monkeypatch.setattr("torchspeed.train.trial.shadow.SHADOW_SHARE", 0.05)
    t = _trainer(tiny_cnn(), AVX2, seconds={"fp32": 1.0, "fp32+channels_last": 1.3})  # never ahead: timed apart
    t.switcher.race = False
    res = t.fit(_loader(n=16 * 60))  # 60 steps: 3 turns (5%)
    trial = res.decisions["switch_trial"]
    assert trial.measured["shadow_steps"] == 3 and t.calls.count("fp32+channels_last+foreach") == 3
    assert "afford 3 turns timed apart" in trial.measured["dropped"]["fp32+channels_last+foreach"]
    assert res.decisions["channels_last"].value is False and res.steps == 60  # decided on its 2 timed turns
    long = _trainer(tiny_cnn(), AVX2, seconds={"fp32": 1.0, "fp32+channels_last": 1.3})
    long.switcher.race = False
    assert long.fit(_loader(n=16 * 200)).decisions["switch_trial"].measured["shadow_steps"] == 7  # 5% of 200: all


def test_a_layout_trains_its_turns_only_once_it_leads_by_ahead(tiny_cnn):
    """A channels_last 5% faster is timed apart on every turn (a lead that small may be one step's noise, and a run
    that ends up keeping the plain layout must keep its numerics); one 30% faster (AHEAD: 10%) trains its turns
    after the first look (the run is likely to switch)."""
    shadowed = {}
    for cl in (0.95, 0.7):
        t = _trainer(tiny_cnn(), AVX2, seconds={"fp32": 1.0, "fp32+channels_last": cl})
        t.switcher.race = False
        res = t.fit(_loader(n=16 * 200))
        assert res.decisions["channels_last"].value is True
        shadowed[cl] = res.decisions["switch_trial"].measured["shadow_steps"]
    assert shadowed == {0.95: 7, 0.7: 2}


def test_on_a_run_that_switches_only_ten_percent_faster_a_lead_never_trains(tiny_cnn):
    """A run given its LR (min_gain AHEAD: the plan's PORTED_MIN_GAIN) keeps its loop's numbers unless a change pays:
    a channels_last that leads by 30% over the first round and then falls back (1.3x slower) is timed apart on
    every turn, and the run that keeps NCHW ends with the weights of a run without a trial, bit for bit. Fails with
    the lead rule of a run not given its LR (its later turns train, and the weights move)."""
    from torchspeed.train.trial.switch_choice import AHEAD

    x, y = torch.randn(16 * 100, 3, 8, 8), torch.randint(0, 4, (16 * 100,))
    seen = []

    def measure(s, sec):
        if "channels_last" not in s.label():
            return 1.0
        seen.append(1)
        return 0.7 if len(seen) <= 2 else 1.3  # ahead over the first round, behind after

    def prepare(t):
        t.switcher.measure_fn = measure
        t.switcher.race = False
    res, plain = _with_and_without_trial(
        tiny_cnn, lambda: DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), AVX2,
        trial={"trial": True, "min_gain": AHEAD}, plain={"trial": False, "channels_last": False}, prepare=prepare)
    d = res.decisions
    assert d["channels_last"].value is False and res.steps == plain.steps == 100
    assert d["switch_trial"].measured["shadow_steps"] == 7  # channels_last's warm-up and 3 rounds x 2 turns


@pytest.mark.parametrize("bf16", [False, True])
def test_a_forward_that_writes_its_input_trains_the_batch_the_plain_loop_would(tiny_cnn, bf16):
    """A candidate timed apart runs the model on a copy of the batch: a forward that scales its input in place
    (`x.mul_(0.5)`) would otherwise hand the trained step a batch it had already scaled. channels_last timed apart on
    every turn (injected timings, never ahead; with bf16 candidates too, whose numerics guard runs the model on the
    first samples); the run that keeps fp32 NCHW ends with the weights of a run without a trial, bit for bit. Fails
    with the pass (or the guard) on the batch itself."""
    class HalvesItsInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = tiny_cnn()

        def forward(self, x):
            x.mul_(0.5)
            return self.net(x)

    def batches():
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(60)]
    seconds = {"fp32": 1.0, "fp32+channels_last": 1.3, "bf16": 1.3, "bf16+channels_last": 1.3}
    res, _ = _with_and_without_trial(  # fresh tensors for each run (`batches`): only the run itself can write them
        HalvesItsInput, batches, BF16_CPU if bf16 else AVX2, trial={"trial": True, "seconds": seconds},
        plain={"trial": False, "channels_last": False, "precision": "fp32"},
        prepare=lambda t: setattr(t.switcher, "race", False))
    d = res.decisions
    assert d["channels_last"].value is False and d["switch_trial"].measured["shadow_steps"] >= 2
    assert d["precision"].value == "fp32"


def test_buffers_a_forward_writes_in_eval_mode_are_the_plain_runs(tiny_cnn):
    """torch.ao's FakeQuantize updates its observer's min/max (and resizes its scale) in every forward, eval mode
    included: the numerics guard's eval-mode losses on the first samples moved a quantisation-aware model's
    observers, and a run whose trial kept fp32 ended off the plain run's weights. bf16 candidates (their guard runs)
    and channels_last timed apart, never ahead (injected timings): the run that keeps fp32 NCHW ends with the plain
    run's weights and buffers, bit for bit. Fails with the guard's pass not putting the buffers back."""
    from torch.ao.quantization import FakeQuantize

    def build():
        return nn.Sequential(tiny_cnn(), FakeQuantize())

    def batches():
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(40)]
    seconds = {"fp32": 1.0, "fp32+channels_last": 1.3, "bf16": 1.3, "bf16+channels_last": 1.3}
    res, _ = _with_and_without_trial(
        build, batches, BF16_CPU, trial={"trial": True, "seconds": seconds},
        plain={"trial": False, "channels_last": False, "precision": "fp32"},
        prepare=lambda t: setattr(t.switcher, "race", False))
    d = res.decisions
    assert d["precision"].value == "fp32" and d["channels_last"].value is False
    assert set(d["switch_trial"].measured["losses"]) == {"fp32", "bf16"}  # the guard ran


def test_a_turn_timed_apart_counts_the_candidates_pass_once_for_each_the_step_runs(monkeypatch):
    """A timed-apart turn swaps the trained step's forward and backward for the candidate's. SAM's step runs two
    (the batch's, then its closure's at a nearby point; L-BFGS's line search more): each is the candidate's, so the
    candidate's single timed pass counts twice. Counted once, a candidate no faster read 2x faster, and ported runs
    of SAM and L-BFGS switched to bf16 (zoo forms, host and AMX). A fake clock that only forward and backward move
    (1 s each): the candidate's step reads the plain step's 2 s. Fails with the pass counted once (1 s)."""
    import types

    from torchspeed.train.loop.trainer import Trainer
    from torchspeed.train.trial import shadow as shadow_mod
    from torchspeed.train.trial.switch_choice import AHEAD

    class SAM(torch.optim.Optimizer):  # the script's own: its step takes the closure (fit gives it one)
        def __init__(self, params):
            self.base = torch.optim.SGD(params, lr=0.05)
            super().__init__(self.base.param_groups, {})
            self.param_groups = self.base.param_groups

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    p.add_(0.01 * p.grad)
            self.zero_grad()
            torch.enable_grad()(closure)()
            self.base.step()

    clock = [0.0]
    monkeypatch.setattr(shadow_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    real = Trainer.forward_backward

    def forward_backward(self, batch):
        clock[0] += 1.0
        return real(self, batch)
    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 4))
    t = _trainer(model, BF16_CPU, optimizer=SAM(model.parameters()), min_gain=AHEAD)
    apart = []

    def measure(s, sec):
        if s.precision == "bf16":
            apart.append(sec)
            return 1.3  # keep fp32: the run's numbers stay the plain ones
        return 1.0
    t.switcher.measure_fn = measure
    t.fit(_loader(n=16 * 40))
    assert apart and all(sec == pytest.approx(2.0) for sec in apart), apart


def test_real_measurement_and_the_second_fit_measures_zero_steps(tiny_cnn, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    kw = dict(epochs=1, trial=True, progress=False, compile=False, lr=0.05)
    r1 = torchspeed.fit(tiny_cnn(), _loader(n=320), **kw)
    first = r1.decisions["switch_trial"]
    assert first.value == "measured" and first.measured["steps"] > 0 and r1.steps == 20
    r2 = torchspeed.fit(tiny_cnn(), _loader(n=320), **kw)
    assert r2.decisions["switch_trial"].value == "cached" and r2.decisions["switch_trial"].measured["steps"] == 0
    assert r2.decisions["precision"].value == r1.decisions["precision"].value
    assert r2.decisions["channels_last"].value == r1.decisions["channels_last"].value


def test_a_corrupt_cache_file_warns_and_the_run_completes(tiny_cnn, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    (tmp_path / "trials.json").write_text('{"abc": [1, 2, ')  # a half-written file
    with caplog.at_level("WARNING", logger="torchspeed"):
        res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, trial=True, progress=False, compile=False, lr=0.05)
    assert res.steps == 4 and res.decisions["switch_trial"].value == "measured"
    assert any("ignored" in r.getMessage() and "trials.json" in r.getMessage() for r in caplog.records)


def test_fit_and_the_bench_all_row_make_the_same_decisions(monkeypatch):
    """The bench's `all` row runs what fit does: the same trial, so the same choice (injected timings)."""
    from torchspeed.bench import _worker
    from torchspeed.bench.runner import bench_configs
    from torchspeed.bench.workloads import create_model
    from torchspeed.train.loop.trainer import Trainer

    seconds = {"fp32+fused": 1.0, "fp32+channels_last+fused": 0.7, "bf16+fused": 0.9,
               "bf16+channels_last+fused": 0.8, "fp32+channels_last+foreach": 0.75}
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx512_bf16")
    monkeypatch.setattr(SwitchStage, "measure_fn", staticmethod(lambda s, sec: seconds[s.label()]))
    all_cfg = next(c for c in bench_configs(torch.device("cpu"), compile=False) if c.name == "all").train
    from dataclasses import asdict
    spec = {"data": "synthetic", "train_size": 64, "val_size": 32, "seed": 0, "device": "cpu", "num_workers": 0,
            "batch_size": 16, "model": "resnet20", "lr": 0.05, "train": asdict(all_cfg), "image_size": 8}
    state = _worker._TrainerState(spec)
    state.warm_up(1)
    torch.manual_seed(0)
    # no LR given: a run given its own LR keeps torch's optimizer kernel (the plan's kernel rule), and the `all` row
    # is fit's own choice of everything
    res = torchspeed.fit(create_model("resnet20", image_size=8), state.loader, epochs=10, trial=True,
                         progress=False, compile=False, schedule=None)
    keys = ("precision", "channels_last", "fused_optimizer")
    assert {k: state.trainer.decisions[k].value for k in keys} == {k: res.decisions[k].value for k in keys} == \
        {"precision": "fp32", "channels_last": True, "fused_optimizer": True}


def test_a_run_given_its_lr_takes_a_layout_only_ten_percent_faster(monkeypatch, tiny_cnn, tmp_path):
    """channels_last moves a conv net's numbers, and a ported loop's must stay the loop's unless the change pays: on a
    run given its LR the trial takes a layout only 10% faster a step (the plan's min_gain); a run that gave no LR
    takes it at 2%. Injected timings (channels_last 5% faster), CPU profile without bf16 (the layout is the one
    change). Fails with the plan's rule off (both runs switch)."""
    from torchspeed.plan.planner import PORTED_MIN_GAIN

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx2")
    monkeypatch.setattr(SwitchStage, "measure_fn", staticmethod(
        lambda s, sec: 0.95 if s.channels_last else 1.0))
    kw = dict(epochs=2, trial=True, progress=False, compile=False, optimizer="adamw", schedule=None)
    given = torchspeed.fit(tiny_cnn(), _loader(n=320), lr=1e-2, **kw)
    assert given.config["min_gain"] == PORTED_MIN_GAIN == 1.1
    assert given.decisions["switch_trial"].value == "measured" and given.decisions["channels_last"].value is False
    fits_own = torchspeed.fit(tiny_cnn(), _loader(n=320), **kw)
    assert fits_own.config["min_gain"] == 1.02 and fits_own.decisions["channels_last"].value is True


def test_in_process_malloc_settings_cut_page_faults():
    """Page faults per training step in one process, before and after `tune_malloc` (no timing)."""
    import subprocess
    import sys

    code = r"""
import os, resource, torch
for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"): assert k not in os.environ
torch.set_num_threads(1)
from torchspeed.bench.workloads import create_model
from torchspeed.train.trial.backends import tune_malloc
m = create_model("resnet20"); opt = torch.optim.SGD(m.parameters(), lr=0.1)
x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
def faults(n=4):
    for _ in range(2):
        torch.nn.functional.cross_entropy(m(x), y).backward(); opt.step(); opt.zero_grad()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        torch.nn.functional.cross_entropy(m(x), y).backward(); opt.step(); opt.zero_grad()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n
before = faults()
d = tune_malloc()
print(before, faults(), d.value)
"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    before, after, applied = out.stdout.split()
    if applied != "True":
        pytest.skip("not glibc malloc here: nothing to tune")
    assert float(after) < 0.3 * float(before), (before, after)


def test_tune_malloc_calls_mallopt_with_the_bench_settings(monkeypatch):
    import torchspeed.train.trial.backends as backends

    monkeypatch.setattr(backends, "allocator_in_use", lambda: "glibc")
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(k, raising=False)
    calls = []
    d = backends.tune_malloc(mallopt=lambda param, value: calls.append((param, value)) or 1)
    assert d.value is True and calls == [(-3, 32 << 20), (-1, 1 << 30)]
    monkeypatch.setattr(backends, "allocator_in_use", lambda: "tcmalloc")
    assert backends.tune_malloc(mallopt=lambda *a: 1).value is False


def test_decisions_are_decision_objects_and_json_ready(tiny_cnn, tmp_path):
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, progress=False, compile=False, out_dir=str(tmp_path))
    for k in ("precision", "channels_last", "compile", "optimizer"):
        assert isinstance(res.decisions[k], Decision), k
    import json
    written = json.loads((tmp_path / "metrics.json").read_text())["decisions"]
    assert written["channels_last"]["value"] in (True, False) and "reason" in written["precision"]


def test_a_candidate_that_cannot_run_is_out_of_the_race(tiny_cnn, monkeypatch):
    from torchspeed.train.loop.trainer import Trainer

    real = Trainer.forward_backward

    def forward_backward(self, batch):  # an operator the model uses has no bf16 kernel: its forward fails
        if self.precision.name == "bf16":
            raise RuntimeError("bf16 is not supported by this operator")
        return real(self, batch)
    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)
    t = _trainer(tiny_cnn(), BF16_CPU, seconds={"fp32": 1.0, "fp32+channels_last": 0.9, "bf16": 0.5,
                                                "bf16+channels_last": 0.4})
    res = t.fit(_loader(n=320))
    assert res.steps == 20 and res.decisions["precision"].value == "fp32"
    assert "bf16+foreach" in res.decisions["switch_trial"].measured["failed"]


def test_threads_are_measured_only_when_loader_workers_share_the_cores(tiny_cnn):
    from torchspeed.train.trial.trial_size import _thread_choices

    ds = _loader().dataset
    assert _thread_choices(DataLoader(ds, num_workers=1), torch.device("cpu"), AVX2) == (2, 1)
    assert _thread_choices(DataLoader(ds), torch.device("cpu"), AVX2) == ()  # no workers: all cores
    assert _thread_choices(DataLoader(ds, num_workers=1), torch.device("cpu"), DeviceCaps("cpu", cores=1)) == ()
    threads = torch.get_num_threads()
    try:
        t = _trainer(tiny_cnn(), AVX2, seconds={"fp32": 1.0, "fp32+channels_last": 0.8,
                                                "fp32+channels_last+2 threads": 0.8,
                                                "fp32+channels_last+1 threads": 0.6})
        samples = [ds[i] for i in range(len(ds))]  # not tensors in memory: the loader keeps its worker
        res = t.fit(DataLoader(samples, batch_size=4, num_workers=1))
        assert res.decisions["threads"].value == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_decisions_dump_to_json_as_they_are():
    import json
    d = Decision("bf16", "measured", {"x": 1.0})
    assert json.loads(json.dumps({"precision": d})) == {"precision": {"value": "bf16", "reason": "measured",
                                                                      "measured": {"x": 1.0}}}
    assert d.value == "bf16" and str(d) == "bf16 (measured)" and Decision(True, "r").measured is None


def test_a_trial_measured_under_other_kernels_is_not_reused(tiny_cnn, tmp_path, monkeypatch):
    """ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA change which kernels run (bf16 measured 12x slower with AVX2
    kernels on a bf16 CPU): the cache key holds them, so a run under other kernels measures afresh."""
    from torchspeed.train.trial import autoswitch

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autoswitch, "kernel_isa", lambda: {"aten": "AVX512", "onednn": None})

    def run():
        t = _trainer(tiny_cnn(), BF16_CPU, channels_last=False)
        t.fit(_loader(n=160))
        return t.decisions["switch_trial"].value
    assert run() == "measured" and run() == "cached"
    monkeypatch.setattr(autoswitch, "kernel_isa", lambda: {"aten": "AVX2", "onednn": "AVX2"})
    assert run() == "measured"


def _drive(trial, seconds):
    while not trial.done:
        trial.record(seconds[trial.current().label()])
    return trial.best


def test_the_optimizer_kernel_stage_keeps_the_kernel_the_run_started_with_within_noise():
    """A short trial cannot resolve a 10% step difference: within min_gain the run keeps its (the rule's) fused
    kernel rather than foreach; foreach is taken only when it measures clearly faster."""
    from torchspeed.train.trial.switches import LiveTrial

    grid = [Switches("fp32", False, True)]
    tie = LiveTrial(grid, fused_choice=True, rounds=2, steps=1, warmup=1)
    assert _drive(tie, {"fp32+fused": 1.0, "fp32+foreach": 0.99}) == Switches("fp32", False, True)
    assert "the kernel the run started with" in tie.report["stages"][-1]["why"]
    clear = LiveTrial(grid, fused_choice=True, rounds=2, steps=1, warmup=1)
    assert _drive(clear, {"fp32+fused": 1.0, "fp32+foreach": 0.8}).fused is False
    started_foreach = LiveTrial([Switches("fp32", False, False)], fused_choice=True, rounds=2, steps=1, warmup=1)
    assert _drive(started_foreach, {"fp32+fused": 0.99, "fp32+foreach": 1.0}).fused is False


def test_the_numerics_guard_reads_a_few_samples_in_each_precision(tiny_cnn, monkeypatch):
    """Before the first step, one no-grad forward per candidate precision on the first GUARD_SAMPLES samples. (Read
    where the guard calls the forward: a hook of the test's own is the user's, whose state the trial puts back.)"""
    from torchspeed.train.loop.batch import batch_size
    from torchspeed.train.trial import autoswitch
    from torchspeed.train.trial.autoswitch import GUARD_SAMPLES

    t = _trainer(tiny_cnn(), BF16_CPU, seconds={"fp32": 1.0, "fp32+channels_last": 1.0, "bf16": 1.0,
                                                "bf16+channels_last": 1.0})
    guard, forward_loss = [], autoswitch.forward_loss

    def counted(module, batch, **kw):
        if not torch.is_grad_enabled():
            guard.append(batch_size(batch))
        return forward_loss(module, batch, **kw)
    monkeypatch.setattr(autoswitch, "forward_loss", counted)
    res = t.fit(_loader(n=16 * 30))
    assert guard == [GUARD_SAMPLES, GUARD_SAMPLES] and GUARD_SAMPLES < 16  # fp32 and bf16, not the whole batch
    assert set(res.decisions["switch_trial"].measured["losses"]) == {"fp32", "bf16"}


def test_the_rules_reasons_say_what_decided_each_switch(tiny_cnn):
    """trial=False with the precision and layout asked for: the kernel's reason is the kernel's rule, and nothing
    claims the CPU lacks the half precision it has."""
    t = _trainer(tiny_cnn(), BF16_CPU, trial=False, precision="fp32", channels_last=True, fused_optimizer="auto")
    d = t.fit(_loader(n=32)).decisions
    assert d["fused_optimizer"].value is True and d["fused_optimizer"].reason == "rule: the fused kernel where torch has one"
    assert d["precision"].reason == d["channels_last"].reason == "asked for"
    assert not any("no native half precision" in str(v) for v in d.values())


def test_the_optimizer_kernel_stage_times_the_optimizer_step_alone(tiny_cnn, monkeypatch, fake_clock):
    """On a fake clock: every training forward costs 100 ms, the fused step 2 ms and the foreach step 6 ms. The
    kernel stage records the optimizer step's own seconds (its hooks); the layout stage and the times the compile
    trial reads stay whole steps."""
    from torchspeed.train.loop import step
    from torchspeed.train.trial import autoswitch, shadow

    monkeypatch.setattr(autoswitch, "time", fake_clock)
    monkeypatch.setattr(shadow, "time", fake_clock)  # channels_last's turns are timed apart there
    monkeypatch.setattr(step, "time", fake_clock)  # the optimizer step's clock (step.OptimizerClock)
    t = _trainer(tiny_cnn(), AVX2, fused_optimizer="auto")
    t.module[0].register_forward_pre_hook(lambda m, a: fake_clock.advance(0.1) if torch.is_grad_enabled() else None)
    t.optimizer.register_step_post_hook(
        lambda opt, *a: fake_clock.advance(0.002 if opt.defaults.get("fused") else 0.006))
    trials = []
    real_finish = SwitchStage.finish
    monkeypatch.setattr(SwitchStage, "finish", lambda self: (trials.append(self.live), real_finish(self))[1])
    res = t.fit(_loader(n=16 * 200))
    stages = {s["stage"]: s for s in res.decisions["switch_trial"].measured["stages"]}
    kernel, layout = stages["optimizer kernel"], stages["precision x layout"]
    assert kernel["timed"] == "the optimizer step" and layout["timed"] == "the step"
    secs = kernel["seconds_per_step"]
    assert secs[kernel["chosen"]] == pytest.approx(0.002) and max(secs.values()) == pytest.approx(0.006)
    assert res.decisions["fused_optimizer"].value is True
    assert all(v >= 0.1 for v in layout["seconds_per_step"].values())
    assert trials and all(x >= 0.1 for x in trials[0].winner_times())  # whole eager steps for the compile trial


def test_a_trial_cached_by_another_method_is_measured_again(tiny_cnn, monkeypatch):
    """The cache key holds the trial's method: an entry the same model left under an earlier method is not read."""
    from torchspeed.train.trial import autoswitch

    seconds = {"fp32": 1.0, "fp32+channels_last": 0.5}
    first = _trainer(tiny_cnn(), AVX2, seconds=seconds)
    first.switcher.measure_fn = None  # real timings, so the result is cached
    first.fit(_loader(n=16 * 40))
    again = _trainer(tiny_cnn(), AVX2)
    assert again.fit(_loader(n=16 * 40)).decisions["switch_trial"].value == "cached"
    monkeypatch.setattr(autoswitch, "TRIAL_METHOD", autoswitch.TRIAL_METHOD + 1)
    later = _trainer(tiny_cnn(), AVX2)
    assert later.fit(_loader(n=16 * 40)).decisions["switch_trial"].value == "measured"


def test_a_measured_kernel_keeps_why_the_optimizer_was_chosen(tiny_cnn):
    """The switch trial changing the kernel describes the new kernel and keeps the reason the optimizer was chosen
    (the plan's recipe, a cache hit): the trial refines the optimizer's decision, it does not replace why."""
    from torchspeed.train import Trainer, TrainConfig
    from torchspeed.train.trial.switch_choice import Switches

    t = Trainer(tiny_cnn(), optimizer="sgd", lr=0.1, device="cpu", config=TrainConfig(
        precision="fp32", channels_last=False, compile=False, trial=False, progress=False, fused_optimizer=True),
        decisions={"optimizer": Decision("schedulefree", "cached: measured by an earlier run")})  # the plan's
    t.switcher.apply(Switches("fp32", False, fused=False))
    d = t.decisions["optimizer"]
    assert "foreach" in d.value and d.reason == "cached: measured by an earlier run; its kernel measured"
    t.switcher.apply(Switches("fp32", False, fused=True))  # the trial's candidates take turns: said once
    t.switcher.apply(Switches("fp32", False, fused=False))
    assert t.decisions["optimizer"].reason == "cached: measured by an earlier run; its kernel measured"


def test_a_one_sample_last_batch_inside_the_trial_fails_no_candidate():
    """BatchNorm refusing an epoch's 1-sample last batch is the batch's fault: the batch is left out (guard.step_failed)
    and the candidate that was on keeps its place in the race."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    t = _trainer(model, BF16_CPU, seconds=STEADY, epochs=3)
    res = t.fit(_loader(n=16 * 3 + 1), epochs=3)  # 3 batches of 16 and one of 1 an epoch; the trial spans epoch 1
    trial = res.decisions["switch_trial"]
    assert res.steps == 9 and trial.measured["steps"] > 4  # the trial was on at the 1-sample batch (the 4th)
    assert trial.measured["failed"] == {}
    assert set(t.calls) == {"fp32+foreach", "fp32+channels_last+foreach", "bf16+foreach", "bf16+channels_last+foreach"}


def test_a_model_autocast_cannot_change_has_no_precision_to_choose():
    """A float64 model (or one cast to bf16 already): autocast casts float32 operations only, so the trial times no
    half-precision candidate (it would time the same work twice) and the rules say fp32, with why."""
    from torchspeed.train.trial.switch_choice import rule_choice

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(64, 8, generator=g, dtype=torch.float64),
                                      torch.randint(0, 3, (64,), generator=g)), batch_size=16)
    d = _trainer(model, BF16_CPU).fit(loader).decisions
    assert d["precision"].value == "fp32" and "float64: autocast casts float32 operations only" in d["precision"].reason
    assert d["switch_trial"].value == "none"  # nothing left to choose on this model: no trial step
    sw, dec = rule_choice(model, caps=BF16_CPU)
    assert sw.precision == "fp32" and "float64" in dec["precision"].reason
    assert rule_choice(model.to(torch.bfloat16), caps=BF16_CPU)[0].precision == "fp32"
    wide = nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 512))  # float32, products large enough
    assert rule_choice(wide, caps=BF16_CPU)[0].precision == "bf16"  # float32 weights: the rule stands


def test_the_cpu_rule_keeps_fp32_for_a_model_of_small_products():
    """bf16 on a CPU casts every weight each forward: a model whose weight matrices are all small (no convolution)
    loses more to the casts than it gains (measured 0.47-0.67x at widths 64-256, batch 32), so the rule keeps
    fp32 there, with why; a wide MLP, a conv net and a GPU keep the half precision."""
    from torchspeed.train.trial.switch_choice import rule_choice, rule_switches, small_products

    tiny = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    sw, dec = rule_choice(tiny, caps=BF16_CPU)
    assert sw.precision == "fp32" and "largest weight matrix has 16,384 elements" in dec["precision"].reason
    bag = nn.Sequential(nn.EmbeddingBag(100_000, 64), nn.Linear(64, 4))  # a big table, a small product
    assert small_products(bag) is not None and rule_choice(bag, caps=BF16_CPU)[0].precision == "fp32"
    wide = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    assert small_products(wide) is None and rule_choice(wide, caps=BF16_CPU)[0].precision == "bf16"
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.LazyLinear(10))
    assert small_products(conv) is None  # a convolution's rows are batch x pixels: bf16 pays on the CPU
    assert small_products(nn.Sequential(nn.Conv1d(4, 8, 3), nn.Flatten(), nn.Linear(8, 2))) is None  # 1D too
    assert small_products(nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 2))) is None  # a size not known yet
    tied = nn.Linear(64, 50_000)  # an LM head's product is large even when a small model tied it to an embedding
    assert small_products(nn.Sequential(nn.Linear(64, 64), tied)) is None
    assert rule_switches(caps=SM80, has_conv=False, small=small_products(tiny)).precision == "bf16"
    assert rule_switches(caps=BF16_CPU, has_conv=False, precision="bf16", small="small").precision == "bf16"

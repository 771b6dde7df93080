"""The switch trial never ends a run and leaves the user's state as the plain step would (train/trial/user_state.py,
train/trial/trial_safety.py): PyTorch's word-language-model example ported to `fit` (an LSTM whose hidden state the
`step_fn` carries between batches) trains to the end on a CPU with native bf16, with the plain loop's weights where
the trial keeps fp32; so do a decoder that keeps a KV cache on `self` and a module with a Python-side step counter;
a candidate that raises in its turn, or whose following plain step raises, leaves a run that finishes, with a
note; a failure the plain loop raises too is the user's, with the user's message.

The CPU's bf16 is injected (TORCHSPEED_CPU_PROFILE) and the trial's step times too (`measure_fn`: fp32 measures
faster, so the trial keeps the plain settings): nothing here depends on this CPU, its kernels or the clock.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchspeed
from torchspeed.train.trial.autoswitch import SwitchStage

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def bf16_cpu(monkeypatch, tmp_path):
    """A CPU with native bf16 (so the trial has a bf16 candidate), fp32 measured faster, an empty trial cache."""
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx512_bf16")
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(SwitchStage, "measure_fn", staticmethod(lambda s, sec: 1.0 if s.precision == "fp32" else 1.3))


class WordLM(nn.Module):
    """pytorch/examples word_language_model's RNNModel("LSTM"), small: log_softmax out, hidden in and out."""

    def __init__(self, vocab=40, width=24, layers=2):
        super().__init__()
        self.drop, self.encoder = nn.Dropout(0.2), nn.Embedding(vocab, width)
        self.rnn, self.decoder = nn.LSTM(width, width, layers, dropout=0.2), nn.Linear(width, vocab)
        self.vocab, self.width, self.layers = vocab, width, layers

    def forward(self, tokens, hidden):
        out, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return nn.functional.log_softmax(self.decoder(self.drop(out)).view(-1, self.vocab), dim=1), hidden

    def init_hidden(self, batch):
        w = next(self.parameters())
        return w.new_zeros(self.layers, batch, self.width), w.new_zeros(self.layers, batch, self.width)


class CellLM(WordLM):
    """The same language model with its recurrence written out in `nn.Linear`s (a tanh RNN): its bf16 pass runs
    on every CPU's kernels, where oneDNN's bf16 LSTM needs AVX-512 (on an AVX2-only CPU the bf16 candidate fails in
    its own pass, and the trial drops it: `_bf16_candidate_ran`)."""

    def __init__(self, vocab=40, width=24, layers=2):
        super().__init__(vocab, width, layers)
        self.rnn = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(layers))

    def forward(self, tokens, hidden):
        h0, c0 = hidden
        x, states = self.drop(self.encoder(tokens)), []
        for layer, cell in enumerate(self.rnn):
            h, outs = h0[layer], []
            for t in range(x.size(0)):
                h = torch.tanh(cell(torch.cat([x[t], h], dim=-1)))
                outs.append(h)
            x = torch.stack(outs)
            states.append(h)
        out = nn.functional.log_softmax(self.decoder(self.drop(x)).view(-1, self.vocab), dim=1)
        return out, (torch.stack(states), c0)


def _bf16_candidate_ran(report: dict) -> bool:
    """The bf16 candidate took turns timed apart on the run, or its own pass failed and the trial dropped it (this
    CPU's kernels cannot run the model in bf16): either way its pass ran in the run's state."""
    return report.get("shadow_steps", 0) >= 1 or any(k.startswith("bf16") for k in report.get("failed", {}))


def _text_batches(n=10, bptt=12, batch=6, vocab=40):
    g = torch.Generator().manual_seed(3)
    stream = torch.randint(0, vocab, (bptt * n + 1, batch), generator=g)
    return [(stream[i:i + bptt], stream[i + 1:i + 1 + bptt].reshape(-1)) for i in range(0, bptt * n, bptt)]


def _carried_step_fn():
    state = {"hidden": None}
    crit = nn.NLLLoss()

    def step_fn(model, batch):
        tokens, targets = batch
        if state["hidden"] is None:
            state["hidden"] = model.init_hidden(tokens.size(1))
        out, hidden = model(tokens, tuple(h.detach() for h in state["hidden"]))
        state["hidden"] = hidden
        return crit(out, targets)
    return step_fn, state


def _plain_loop(model, batches, step_fn, lr, clip=None):
    """The script's own loop: SGD, clipping, the same batches in order."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for b in batches:
        loss = step_fn(model, b)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def _ported(model, batches, step_fn, lr, **kw):
    """`fit` as docs/models.md ports such a loop: the script's optimizer, LR and clipping; the trial live."""
    return torchspeed.fit(model, batches, step_fn=step_fn, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
                          epochs=1, progress=False, compile=False, schedule=None, **kw)


@pytest.mark.parametrize("make", [WordLM, CellLM], ids=["lstm", "linear-cell"])
def test_a_carried_hidden_lstm_trains_to_the_end_on_a_bf16_cpu_with_the_plain_loops_weights(bf16_cpu, make):
    batches = _text_batches()
    torch.manual_seed(0)
    ref = _plain_loop(make(), batches, _carried_step_fn()[0], lr=5.0, clip=0.25)
    torch.manual_seed(0)
    model = make()
    step_fn, state = _carried_step_fn()
    res = _ported(model, batches, step_fn, lr=5.0, clip_grad_norm=0.25)
    report = res.decisions["switch_trial"].measured
    assert res.steps == len(batches) and res.decisions["precision"].value == "fp32"
    assert _bf16_candidate_ran(report)
    if make is CellLM:  # its bf16 pass runs on every CPU: its turns were timed apart, then put back
        assert report["shadow_steps"] >= 1
    assert _same_weights(model, ref)  # the plain loop's numbers, to the last bit
    assert all(h.dtype == torch.float32 for h in state["hidden"])


class HiddenOnSelf(WordLM):
    """The same model keeping its hidden state on `self` between calls (no step_fn): a forward that writes state."""

    def forward(self, tokens):
        if getattr(self, "hidden", None) is None:
            self.hidden = self.init_hidden(tokens.size(1))
        out, hidden = super().forward(tokens, tuple(h.detach() for h in self.hidden))
        self.hidden = hidden
        return out


class KVCacheDecoder(nn.Module):
    """A decoder that keeps the keys and values of earlier segments on `self` (a memory, Transformer-XL style):
    each call attends over the cache and appends its own, the oldest dropped."""

    def __init__(self, vocab=40, width=16, keep=2):
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(vocab, width), nn.Linear(width, 3 * width), nn.Linear(width, vocab)
        self.keep, self.cache = keep, []

    def forward(self, tokens):
        x = self.emb(tokens)  # (batch, time, width)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        keys = torch.cat([c[0] for c in self.cache] + [k], dim=1)
        values = torch.cat([c[1] for c in self.cache] + [v], dim=1)
        att = torch.softmax(q @ keys.transpose(1, 2) / keys.size(-1) ** 0.5, dim=-1)
        self.cache = (self.cache + [(k.detach(), v.detach())])[-self.keep:]
        return self.out(att @ values).flatten(0, 1)


class Counted(nn.Module):
    """A module with a Python-side step counter that its forward reads (a schedule inside the model)."""

    def __init__(self):
        super().__init__()
        self.body, self.calls = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 40)), 0

    def forward(self, tokens):
        self.calls += 1
        return self.body(tokens.float().flatten(1)) * (1.0 + 0.1 * (self.calls % 3))


class NumpyMasked(nn.Module):
    """Drops positions drawn from NumPy's global generator (Hugging Face's wav2vec2 draws its time masks so)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 40))

    def forward(self, tokens):
        import numpy as np

        keep = torch.from_numpy(np.random.rand(*tokens.shape) > 0.2)
        return self.body((tokens.float() * keep).flatten(1))


class OwnGenerator(nn.Module):
    """Noise on the hidden layer drawn from a torch.Generator the module holds (not torch's global one)."""

    def __init__(self):
        super().__init__()
        self.body, self.out = nn.Sequential(nn.Linear(12, 32), nn.ReLU()), nn.Linear(32, 40)
        self.gen = torch.Generator().manual_seed(7)

    def forward(self, tokens):
        h = self.body(tokens.float().flatten(1))
        return self.out(h + 0.3 * torch.randn(h.shape, generator=self.gen))


def _seq_batches(make):
    """Time-major batches for the LSTM; batch-major for the decoder; one target a sequence for the counter model."""
    out = []
    for x, y in _text_batches():  # x: (time, batch); y: (time * batch,)
        if make is HiddenOnSelf:
            out.append((x, y))
        elif make is KVCacheDecoder:
            out.append((x.t().contiguous(), y.view(x.shape).t().reshape(-1)))
        else:
            out.append((x.t().contiguous(), y.view(x.shape)[0]))
    return out


@pytest.mark.parametrize("make", [HiddenOnSelf, KVCacheDecoder, Counted, NumpyMasked, OwnGenerator],
                         ids=["hidden-on-self", "kv-cache", "step-counter", "numpy-rng", "own-generator"])
def test_a_model_that_keeps_state_between_calls_trains_with_the_plain_loops_weights(bf16_cpu, make):
    batches = _seq_batches(make)
    loss = nn.NLLLoss() if make is HiddenOnSelf else nn.CrossEntropyLoss()

    def step_fn(model, batch):
        return loss(model(batch[0]), batch[1])
    import numpy as np

    torch.manual_seed(0)
    np.random.seed(0)
    ref = _plain_loop(make(), batches, step_fn, lr=0.5)
    torch.manual_seed(0)
    np.random.seed(0)
    model = make()
    res = torchspeed.fit(model, batches, loss_fn=loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), epochs=1,
                         progress=False, compile=False, schedule=None)
    assert res.steps == len(batches) and res.decisions["precision"].value == "fp32"
    assert _bf16_candidate_ran(res.decisions["switch_trial"].measured)
    assert _same_weights(model, ref)
    if make is Counted:
        assert model.calls == ref.calls == len(batches)  # the measuring passes' counts were put back


class MomentumTarget(nn.Module):
    """BYOL's shape: an online network and a target copy that needs no gradient, moved by the step."""

    def __init__(self):
        super().__init__()
        self.online = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16))
        self.target = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16)).requires_grad_(False)

    def forward(self, x):
        return self.online(x)


def test_a_step_that_moves_a_frozen_target_network_in_place_trains_with_the_plain_loops_weights(bf16_cpu):
    """A pass that only measures ran the step once more: its momentum update moved the target a second time, and a
    run whose trial kept fp32 ended off its loop's weights. The frozen parameters are put back with the rest."""
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(16, 12, generator=g), torch.zeros(16)) for _ in range(300)]

    def step_fn(model, batch):
        with torch.no_grad():
            for po, pt in zip(model.online.parameters(), model.target.parameters()):
                pt.mul_(0.9).add_(po, alpha=0.1)
        x = batch[0]
        p, t = F.normalize(model(x), dim=-1), F.normalize(model.target(x + 0.1), dim=-1)
        return (2 - 2 * (p * t).sum(-1)).mean()

    torch.manual_seed(0)
    ref = _plain_loop(MomentumTarget(), batches, step_fn, lr=0.1)
    torch.manual_seed(0)
    model = MomentumTarget()
    res = torchspeed.fit(model, batches, step_fn=step_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         epochs=1, progress=False, compile=False, schedule=None)
    assert res.decisions["precision"].value == "fp32" and _bf16_candidate_ran(res.decisions["switch_trial"].measured)
    assert _same_weights(model, ref)


def test_a_count_the_step_keeps_on_a_torch_sequential_model_is_the_plain_loops(bf16_cpu):
    """A script's `nn.Sequential` model carries a count its step sets on it (`model.seen`), which weighs the loss
    (a curriculum): torch's own classes keep no forward state, so the walk had skipped their attributes, a pass
    that only measures counted once more, and a run whose trial kept fp32 ended off its loop's weights."""
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(120)]

    def step_fn(model, batch):
        model.seen = getattr(model, "seen", 0) + 1
        x, y = batch
        return (1.0 if model.seen % 3 else 0.25) * F.cross_entropy(model(x), y)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))

    ref = _plain_loop(make(), batches, step_fn, lr=0.2)
    model = make()
    res = _ported(model, batches, step_fn, lr=0.2)
    assert res.decisions["precision"].value == "fp32" and _bf16_candidate_ran(res.decisions["switch_trial"].measured)
    assert model.seen == len(batches) and _same_weights(model, ref)


def test_a_candidate_that_raises_in_its_turn_after_writing_the_state_leaves_a_run_that_finishes(bf16_cpu):
    """The step_fn stores its bf16 hidden state, then an op with no bf16 kernel raises: the state is put back as
    the step found it, the candidate dropped with its error in the trial's report, the batch trained in fp32."""
    batches = _text_batches()
    inner, state = _carried_step_fn()

    def step_fn(model, batch):
        loss = inner(model, batch)
        if state["hidden"][0].dtype == torch.bfloat16:
            raise NotImplementedError("'my_op' has no BFloat16 kernel")
        return loss
    torch.manual_seed(0)
    ref = _plain_loop(CellLM(), batches, _carried_step_fn()[0], lr=5.0)
    torch.manual_seed(0)
    model = CellLM()  # its bf16 pass runs on every CPU, so the step_fn's own error is the one raised
    res = _ported(model, batches, step_fn, lr=5.0)
    assert res.steps == len(batches) and res.decisions["precision"].value == "fp32"
    assert "no BFloat16 kernel" in res.decisions["switch_trial"].measured["failed"]["bf16+foreach"]
    assert _same_weights(model, ref)


_LEFT = {"half": False}  # state the trial cannot see: a global of this module, read by the model's forward


class Fussy(nn.Module):
    """Runs in bf16, and in fp32 until a bf16 pass has run: then an fp32 pass raises (state left where no walk
    reaches it, as a C extension's object would be)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 40))

    def forward(self, tokens):
        if torch.is_autocast_enabled("cpu"):
            _LEFT["half"] = True
        elif _LEFT["half"]:
            raise RuntimeError("a buffer left in bf16 by an earlier pass")
        return self.body(tokens.float().flatten(1))


def test_a_candidate_whose_following_plain_step_raises_leaves_a_run_that_finishes_in_settings_that_work(bf16_cpu):
    _LEFT["half"] = False
    batches = [(x.t().contiguous(), y.view(12, -1)[0]) for x, y in _text_batches()]
    _plain_loop(Fussy(), batches, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), lr=0.1)  # it trains
    model = Fussy()
    res = torchspeed.fit(model, batches, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), epochs=1,
                         progress=False, compile=False, schedule=None)
    _LEFT["half"] = False
    assert res.steps == len(batches)
    assert res.decisions["switch_trial"].value == "fallback" and res.decisions["precision"].value == "bf16"
    assert "bf16" in res.decisions["switch_recovered"].reason and "RuntimeError" in res.decisions[
        "switch_recovered"].reason


def test_a_failure_the_plain_loop_raises_too_keeps_the_users_message(bf16_cpu):
    """A batch the user's code cannot take fails in every setting: raised with the user's own message, not
    swallowed by the trial's recovery and not blamed on a candidate."""
    batches = _text_batches()
    inner, _ = _carried_step_fn()
    seen = []

    def step_fn(model, batch):
        seen.append(1)
        if len(seen) >= 4:
            raise ValueError("batch 4: targets out of range for this vocabulary")
        return inner(model, batch)
    model = WordLM()
    with pytest.raises(ValueError, match="batch 4: targets out of range") as info:
        _ported(model, batches, step_fn, lr=5.0)
    assert "torchspeed" not in str(info.value)


def test_recipe_auto_runs_a_carried_hidden_lstm_whose_plan_trials_ran_its_step_fn(bf16_cpu):
    """recipe="auto" measures before the run (the switch trial on a copy, the recipe's trials) through the user's
    step_fn: what those left in its state (a hidden state of the copy's, in bf16) is put back before the run."""
    batches = _text_batches(n=30)
    model = WordLM()
    step_fn, state = _carried_step_fn()
    res = torchspeed.fit(model, batches, step_fn=step_fn, recipe="auto", epochs=4, progress=False, compile=False)
    assert res.steps == 4 * len(batches) and all(torch.isfinite(torch.tensor(r["train_loss"])) for r in res.history)
    assert state["hidden"][0].dtype == (torch.bfloat16 if res.decisions["precision"].value == "bf16" else
                                        torch.float32)


def test_the_users_hooks_see_each_step_once_and_keep_the_plain_loops_sums(bf16_cpu):
    """A script that logs activations with a forward hook and sums a Fisher information with gradient hooks: the
    trial's passes that only measure (a bf16 candidate timed apart, the numerics guard's forward) had run the hooks
    too, so the list held more entries than steps and the sums were off the plain loop's."""
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(120)]

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))
        acts, fisher = [], {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        model[1].register_forward_hook(lambda m, i, o: acts.append(float(o.detach().float().mean())))
        for n, p in model.named_parameters():
            p.register_hook(lambda grad, n=n: fisher[n].add_(grad.detach().float() ** 2))
        return model, acts, fisher

    def step_fn(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    ref, ref_acts, ref_fisher = make()
    _plain_loop(ref, batches, step_fn, lr=0.1)
    model, acts, fisher = make()
    res = _ported(model, batches, step_fn, lr=0.1)
    assert res.decisions["precision"].value == "fp32" and _bf16_candidate_ran(res.decisions["switch_trial"].measured)
    assert acts == ref_acts and all(torch.equal(fisher[n], ref_fisher[n]) for n in fisher)
    assert _same_weights(model, ref)


def test_a_view_that_channels_last_breaks_leaves_a_run_in_nchw_and_says_what_lets_it_run(bf16_cpu):
    """An old script's flatten, `x.view(-1, C * H * W)` after its convolutions: in channels_last the view raises, the
    candidate is dropped, the run trains on in NCHW, and the note names the one-line change that lets it run."""
    class ViewNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 8 * 8, 3)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).view(-1, 4 * 8 * 8))

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(60)]
    torch.manual_seed(0)
    res = _ported(ViewNet(), batches, lambda m, b: F.cross_entropy(m(b[0]), b[1]), lr=0.05)
    assert res.steps == 60 and res.decisions["channels_last"].value is False
    assert "torch.flatten(x, 1) or .reshape()" in res.decisions["switch_recovered"].reason


def test_a_scripts_channels_last_input_stays_so_where_the_trial_keeps_the_plain_settings(bf16_cpu, monkeypatch):
    """Images made from HWC arrays (`torch.from_numpy(img).permute(2, 0, 1)`) come in channels_last strides, and a
    script's convolutions run on them so. The trial's plain steps had copied each batch to NCHW, which computes
    other numbers: a run whose trial kept the plain settings ended off its loop's weights."""
    monkeypatch.setattr(SwitchStage, "measure_fn", staticmethod(
        lambda s, sec: 1.0 if s.precision == "fp32" and not s.channels_last else 1.3))  # the plain settings win
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(8, 12, 12, 3, generator=g).permute(0, 3, 1, 2), torch.randint(0, 3, (8,), generator=g))
               for _ in range(80)]
    assert batches[0][0].is_contiguous(memory_format=torch.channels_last) and not batches[0][0].is_contiguous()

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(16, 3))

    step = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    ref = _plain_loop(make(), batches, step, lr=0.05)
    model = make()
    res = torchspeed.fit(model, batches, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), epochs=1,
                         progress=False, compile=False, schedule=None)
    report = res.decisions["switch_trial"].measured
    assert res.decisions["channels_last"].value is False and res.decisions["precision"].value == "fp32"
    assert report["shadow_steps"] >= 1 and "fp32+channels_last+foreach" in report["stages"][0]["seconds_per_step"]
    assert _same_weights(model, ref)  # the channels_last candidates' turns ran beside the plain steps

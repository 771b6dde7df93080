"""The `model` a `step_fn(model, batch)` is given behaves as the user's own module: its methods (an LSTM language
model's `init_hidden`), submodules and attributes are there, while calling it runs the module `fit` chose (eager or
compiled). A hidden state carried between batches, as PyTorch's word-language-model example does, trains."""

import pytest
import torch
from torch import nn

import torchspeed
from torchspeed.train.trial.compile import CompileController


class WordLM(nn.Module):
    def __init__(self, vocab=30, width=16):
        super().__init__()
        self.encoder, self.rnn, self.decoder = nn.Embedding(vocab, width), nn.LSTM(width, width), nn.Linear(width, vocab)
        self.width = width

    def forward(self, tokens, hidden):
        out, hidden = self.rnn(self.encoder(tokens), hidden)
        return self.decoder(out).flatten(0, 1), hidden

    def init_hidden(self, batch):
        w = next(self.parameters())
        return w.new_zeros(1, batch, self.width), w.new_zeros(1, batch, self.width)


def test_the_controller_reads_through_to_the_users_module():
    model = WordLM()
    ctl = CompileController(model, False, device=torch.device("cpu"))
    assert ctl.width == 16 and ctl.encoder is model.encoder and ctl.init_hidden(3)[0].shape == (1, 3, 16)
    assert not hasattr(ctl, "no_such_attribute")


def test_a_step_fn_is_handed_the_users_module_itself():
    """A step that keeps an EMA of the weights (`AveragedModel(model)` deep-copies what it is given) gets the module
    the user passed, as its own loop would hand it. Before, it got fit's compile controller: the EMA's deep copy had
    no parameters and its second update raised inside torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    batches = [(torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(5)]
    seen, ema = [], {}

    def step_fn(m, batch):
        seen.append(m)
        if "avg" not in ema:
            ema["avg"] = torch.optim.swa_utils.AveragedModel(
                m, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        ema["avg"].update_parameters(m)
        x, y = batch
        return nn.functional.cross_entropy(m(x), y)

    start = model[0].weight.detach().clone()
    torchspeed.fit(model, batches, step_fn=step_fn, optimizer="sgd", lr=0.1, epochs=2, progress=False,
                   precision="fp32", channels_last=False, compile=False)
    assert seen and all(m is model for m in seen)
    assert int(ema["avg"].n_averaged) == 10
    averaged = ema["avg"].module[0].weight
    assert not torch.equal(averaged, start) and not torch.equal(averaged, model[0].weight)


def test_the_step_is_handed_the_running_module_or_under_a_wrapper_the_controller():
    model = WordLM()
    ctl = CompileController(model, False, device=torch.device("cpu"))
    assert ctl.for_step_fn() is model
    compiled = nn.Module()
    ctl.active, ctl.mode = compiled, None  # what _use sets once the compile trial chose a compiled module
    assert ctl.for_step_fn() is compiled
    user_compiled = torch.compile(model)  # (not run: compiling costs seconds) the object the user passed
    assert CompileController(user_compiled, False, device=torch.device("cpu")).for_step_fn() is user_compiled
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)  # (no process group)
    wrapped = CompileController(ddp, False, device=torch.device("cpu"))
    assert wrapped.for_step_fn() is wrapped  # DDP's forward must run: it syncs the gradients


def test_a_step_fn_that_carries_a_hidden_state_between_batches_trains():
    torch.manual_seed(0)
    stream = torch.arange(35 * 8 * 6).remainder(30).view(-1, 8)  # a (time, batch) token stream, periodic
    batches = [(stream[i:i + 35], stream[i + 1:i + 36].flatten()) for i in range(0, len(stream) - 36, 35)]
    state = {"hidden": None}

    def step_fn(model, batch):
        tokens, targets = batch
        if state["hidden"] is None:
            state["hidden"] = model.init_hidden(tokens.size(1))
        logits, hidden = model(tokens, tuple(h.detach() for h in state["hidden"]))
        state["hidden"] = hidden
        return nn.functional.cross_entropy(logits, targets)

    model = WordLM()
    res = torchspeed.fit(model, batches, step_fn=step_fn, optimizer="adamw", lr=1e-2, epochs=6, progress=False,
                         precision="fp32", compile=False)
    assert res.steps == 6 * len(batches)
    assert res.history[-1]["train_loss"] < 0.7 * res.history[0]["train_loss"]


def _word_batches():
    stream = torch.arange(12 * 4 * 4).remainder(30).view(-1, 4)
    return [(stream[i:i + 12], stream[i + 1:i + 13].flatten()) for i in range(0, len(stream) - 13, 12)]


def test_a_graph_backed_through_twice_names_the_two_usual_causes_and_their_fixes():
    """A port whose step_fn calls loss.backward() itself, and one that carries its hidden state without detaching
    it: torch's error suggests retain_graph; fit's names what to do instead."""
    state = {"hidden": None}

    def backs_itself(model, batch):
        tokens, targets = batch
        loss = nn.functional.cross_entropy(model(tokens, model.init_hidden(tokens.size(1)))[0], targets)
        loss.backward()
        return loss

    def keeps_the_graph(model, batch):
        tokens, targets = batch
        logits, state["hidden"] = model(tokens, state["hidden"] or model.init_hidden(tokens.size(1)))
        return nn.functional.cross_entropy(logits, targets)

    for step_fn in (backs_itself, keeps_the_graph):
        with pytest.raises(RuntimeError) as info:
            torchspeed.fit(WordLM(), _word_batches(), step_fn=step_fn, progress=False, precision="fp32",
                           compile=False)
        message = str(info.value)
        assert "backward through the graph a second time" in message
        assert "return the loss instead" in message and "hidden.detach()" in message

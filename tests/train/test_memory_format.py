import torch

from torchspeed.train import Trainer, TrainConfig
from torchspeed.train.trial.memory_format import apply_channels_last, has_conv2d, is_channels_last, to_channels_last


def test_apply_channels_last_changes_weight_strides(tiny_cnn):
    model = tiny_cnn()
    w = model[0].weight
    assert not w.is_contiguous(memory_format=torch.channels_last)
    apply_channels_last(model)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    # NHWC: the channel dimension has stride 1
    assert model[0].weight.stride()[1] == 1


def test_inputs_converted_and_outputs_equal(tiny_cnn):
    model = tiny_cnn().eval()
    x = torch.randn(2, 3, 8, 8)
    ref = model(x)
    apply_channels_last(model)
    xc = to_channels_last(x)
    assert is_channels_last(xc) and not is_channels_last(x)
    torch.testing.assert_close(model(xc), ref, rtol=1e-5, atol=1e-5)


def test_trainer_auto_applies_only_to_conv_models(tiny_cnn):
    t = Trainer(tiny_cnn(), device="cpu", config=TrainConfig(progress=False, compile=False))
    assert t.layout_pending  # the rules' layout, put into effect when the Trainer first steps
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert not has_conv2d(mlp)
    t2 = Trainer(mlp, device="cpu", config=TrainConfig(progress=False, compile=False))
    assert t2.channels_last is False and not t2.layout_pending
    # the trainer hands the model channels_last inputs
    batch = next(t.batches([(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))]))
    assert is_channels_last(batch[0])
    assert t.channels_last and t.model[0].weight.is_contiguous(memory_format=torch.channels_last)


def _cnn_batches(n=4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]


def test_a_live_switch_trial_starts_from_the_weights_as_given(tiny_cnn, monkeypatch):
    """A conv net's weights are not copied to the rules' channels_last when the Trainer is built: a live switch trial
    sets the layout from its first step (its first candidate is the plain layout), so a copy there and back is
    saved; where no trial sets it (trial=False, or a Trainer stepped without fit), the rules' layout is applied."""
    import torchspeed.train.trial.memory_format as mf
    from torchspeed.train.trial import autoswitch
    from torchspeed.train.loop import trainer as trainer_mod

    to_cl = []
    real = mf.apply_channels_last

    def spy(model, channels_last=True):
        to_cl.append(channels_last)
        return real(model, channels_last)

    monkeypatch.setattr(trainer_mod, "apply_channels_last", spy)
    monkeypatch.setattr(autoswitch, "apply_channels_last", spy)
    cfg = dict(progress=False, compile=False, precision="fp32", channels_last="auto")
    t = Trainer(tiny_cnn(), device="cpu", lr=0.01, config=TrainConfig(**cfg))
    w = t.model[0].weight
    assert w.is_contiguous() and not w.is_contiguous(memory_format=torch.channels_last) and to_cl == []
    t.switcher.prepare(_cnn_batches(), remaining_steps=400)  # the trial goes live: the layout is its to set
    assert t.switcher.live is not None and not t.layout_pending
    assert t.switcher.live.grid[0].channels_last is False  # its first candidate: the layout as given
    assert to_cl == [] and t.model[0].weight.is_contiguous()

    to_cl.clear()
    off = Trainer(tiny_cnn(), device="cpu", lr=0.01, config=TrainConfig(**cfg, trial=False))
    off.fit(_cnn_batches(), epochs=1)  # no trial: the rules' layout, once
    assert to_cl == [True] and off.channels_last and is_channels_last(off.model[0].weight)
    bench = Trainer(tiny_cnn(), device="cpu", lr=0.01, config=TrainConfig(**cfg))
    bench.run_steps(iter(_cnn_batches()), 1)  # stepped without fit or a trial: the rules' layout
    assert is_channels_last(bench.model[0].weight)


def test_apply_channels_last_leaves_a_5d_parameter_alone_and_converts_back():
    """timm's lambda layers hold a 5-D relative-position parameter: channels_last takes 4-D tensors only
    (module.to(memory_format=...) raised "required rank 4 tensor to use channels_last format")."""
    model = torch.nn.Conv2d(3, 8, 3)
    model.rel = torch.nn.Parameter(torch.randn(2, 3, 4, 5, 6))
    apply_channels_last(model)
    assert is_channels_last(model.weight) and model.rel.is_contiguous()
    apply_channels_last(model, False)
    assert model.weight.is_contiguous() and not is_channels_last(model.weight)

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
    assert t.channels_last and t.model[0].weight.is_contiguous(memory_format=torch.channels_last)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert not has_conv2d(mlp)
    t2 = Trainer(mlp, device="cpu", config=TrainConfig(progress=False, compile=False))
    assert t2.channels_last is False
    # the trainer hands the model channels_last inputs
    batch = next(t.batches([(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))]))
    assert is_channels_last(batch[0])


def test_apply_channels_last_leaves_a_5d_parameter_alone_and_converts_back():
    """timm's lambda layers hold a 5-D relative-position parameter: channels_last takes 4-D tensors only
    (module.to(memory_format=...) raised "required rank 4 tensor to use channels_last format")."""
    model = torch.nn.Conv2d(3, 8, 3)
    model.rel = torch.nn.Parameter(torch.randn(2, 3, 4, 5, 6))
    apply_channels_last(model)
    assert is_channels_last(model.weight) and model.rel.is_contiguous()
    apply_channels_last(model, False)
    assert model.weight.is_contiguous() and not is_channels_last(model.weight)

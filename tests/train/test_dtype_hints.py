"""A batch whose dtype the model's weights refuse gets torch's error with a note that names the dtype and the fix:
float64 (numpy's default), integer inputs (uint8 images) and half-precision ones; an embedding model's int64 ids are
not flagged. A target of Python values and a step_fn that returns a per-sample loss are named with the fix too."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed


def _notes(x, y, model):
    with pytest.raises(RuntimeError) as info:
        torchspeed.fit(model, DataLoader(TensorDataset(x, y), batch_size=8), epochs=1, progress=False, trial=False,
                       compile=False)
    return " ".join(getattr(info.value, "__notes__", []))


def test_uint8_inputs_get_a_note_that_says_convert_them_to_float():
    x = torch.randint(0, 255, (32, 3, 8, 8), dtype=torch.uint8)
    notes = _notes(x, torch.randint(0, 2, (32,)), nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2)))
    assert "integer tensors" in notes and "x.float() / 255" in notes
    notes = _notes(x.flatten(1), torch.randint(0, 2, (32,)), nn.Linear(192, 2))
    assert "integer tensors" in notes


def test_float64_inputs_get_the_float32_note_not_the_integer_one():
    notes = _notes(torch.randn(32, 4, dtype=torch.float64), torch.randint(0, 2, (32,)), nn.Linear(4, 2))
    assert "float64" in notes and "integer tensors" not in notes


def test_an_embedding_models_integer_ids_train():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    res = torchspeed.fit(model, DataLoader(TensorDataset(torch.randint(0, 10, (32, 3)), torch.randint(0, 2, (32,))),
                                           batch_size=8), epochs=1, progress=False, trial=False, compile=False)
    assert res.steps == 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_get_a_note_that_says_keep_them_float32(dtype):
    notes = _notes(torch.randn(32, 4).to(dtype), torch.randint(0, 2, (32,)), nn.Linear(4, 2))
    assert "float16/bfloat16" in notes and "x.float()" in notes and "integer tensors" not in notes


def test_a_target_of_python_values_and_a_per_sample_loss_name_the_fix():
    batches = [(torch.randn(4, 8), [0, 1, 1, 0]) for _ in range(2)]
    with pytest.raises(AttributeError) as info:
        torchspeed.fit(nn.Linear(8, 2), batches, progress=False, trial=False, compile=False)
    assert "list of 4 Python values, not a tensor" in " ".join(info.value.__notes__)
    tensors = [(torch.randn(4, 8), torch.tensor([0, 1, 1, 0])) for _ in range(2)]

    def per_sample(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")
    with pytest.raises(TypeError, match=r"returned Tensor of shape \(4,\): reduce it to one value"):
        torchspeed.fit(nn.Linear(8, 2), tensors, step_fn=per_sample, progress=False, trial=False, compile=False)

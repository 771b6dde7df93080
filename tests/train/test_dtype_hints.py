"""A batch whose dtype the model's weights refuse gets torch's error with a note that names the dtype and the fix:
float64 (numpy's default) and integer inputs (uint8 images); an embedding model's int64 ids are not flagged."""

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

"""A model with a sparse embedding (`nn.EmbeddingBag(..., sparse=True)`, as PyTorch's text-classification
tutorial and recommender scripts have) trains under `fit` with SGD as under the script's own `torch.optim.SGD`:
no fused kernel (it refuses sparse gradients), in the switch trial too, and no weight decay on the sparse weight
(torch cannot add a dense decay to a sparse gradient). Nothing is timed."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train.optim import create_optimizer, param_groups, sparse_gradients
from torchspeed.train.trial.switch_choice import fusable


class Bag(nn.Module):
    def __init__(self, sparse=True):
        super().__init__()
        self.emb, self.fc = nn.EmbeddingBag(50, 8, sparse=sparse), nn.Linear(8, 2)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def _data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (256, 5), generator=g)
    return ids, (ids < 25).sum(1).gt(2).long()


def test_a_sparse_embedding_keeps_the_for_loop_path_and_no_decay():
    model = Bag()
    assert sparse_gradients(model) and not sparse_gradients(Bag(sparse=False))
    no_decay, decay = param_groups(model, 5e-4)
    assert any(p is model.emb.weight for p in no_decay["params"]) and all(p is not model.emb.weight
                                                                          for p in decay["params"])
    opt = create_optimizer("sgd", model, lr=0.1)
    assert not opt.defaults.get("fused") and not fusable(opt, model) and fusable(opt)
    assert create_optimizer("sgd", Bag(sparse=False), lr=0.1).defaults.get("fused")  # a dense model keeps it


def test_fit_trains_a_sparse_embedding_with_sgd_and_its_default_weight_decay():
    torch.manual_seed(0)
    ids, y = _data()
    res = torchspeed.fit(Bag(), DataLoader(TensorDataset(ids, y), batch_size=32, shuffle=True), optimizer="sgd",
                         lr=0.5, epochs=6, progress=False, compile=False)  # the switch trial on: it must not fuse
    assert res.steps == 48 and "fused" not in str(res.decisions["optimizer"].value)
    assert res.history[-1]["train_loss"] < res.history[0]["train_loss"]

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


def _momentum_sgd_steps(opt, model, steps=6):
    ids, y = _data()
    for i in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids[32 * i:32 * (i + 1)]), y[32 * i:32 * (i + 1)]).backward()
        opt.step()


def test_torchs_momentum_buffer_for_a_sparse_gradient_grows_each_step():
    """Why the sparse weight gets no momentum: torch's SGD keeps its buffer sparse and uncoalesced, each step
    appending that step's rows, so the update's cost grows with the steps taken."""
    model = Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _momentum_sgd_steps(opt, model, steps=2)
    two = opt.state[model.emb.weight]["momentum_buffer"]._nnz()
    _momentum_sgd_steps(opt, model, steps=6)
    assert opt.state[model.emb.weight]["momentum_buffer"]._nnz() > 2 * two


def test_sgd_by_name_trains_a_sparse_embedding_without_momentum_and_the_rest_with_it():
    model = Bag()
    opt = create_optimizer("sgd", model, lr=0.1)
    sparse = [g for g in opt.param_groups if any(p is model.emb.weight for p in g["params"])]
    assert len(sparse) == 1 and sparse[0]["params"] == [model.emb.weight]
    assert sparse[0]["momentum"] == 0 and not sparse[0]["nesterov"] and sparse[0]["weight_decay"] == 0
    dense = [g for g in opt.param_groups if g is not sparse[0]]
    assert {id(p) for g in dense for p in g["params"]} == {id(model.fc.weight), id(model.fc.bias)}
    assert all(g["momentum"] == 0.9 and g["nesterov"] for g in dense)
    _momentum_sgd_steps(opt, model)
    assert opt.state[model.emb.weight].get("momentum_buffer") is None  # nothing kept, nothing growing
    assert opt.state[model.fc.weight]["momentum_buffer"] is not None
    assert [g["params"] for g in create_optimizer("sgd", Bag(sparse=False), lr=0.1).param_groups
            if g.get("momentum") == 0] == []  # a dense model keeps momentum everywhere


def test_auto_on_a_sparse_embedding_keeps_sgd_with_no_momentum_on_the_sparse_rows():
    from torchspeed.train.loop.callbacks import Callback

    class Seen(Callback):
        def on_before_optimizer_step(self, trainer, optimizer):
            self.optimizer = optimizer
    torch.manual_seed(0)
    ids, y = _data()
    model, seen = Bag(), Seen()
    res = torchspeed.fit(model, DataLoader(TensorDataset(ids, y), batch_size=32, shuffle=True), recipe="auto",
                         epochs=3, progress=False, compile=False, callbacks=[seen])
    assert str(res.decisions["optimizer"].value).lower() == "sgd" and isinstance(seen.optimizer, torch.optim.SGD)
    assert res.history[-1]["train_loss"] < res.history[0]["train_loss"]
    assert seen.optimizer.state[model.emb.weight].get("momentum_buffer") is None
    assert seen.optimizer.state[model.fc.weight].get("momentum_buffer") is not None


def test_a_frozen_sparse_embedding_adds_no_empty_group():
    model = Bag()
    model.emb.weight.requires_grad_(False)
    opt = create_optimizer("sgd", model, lr=0.1)
    assert all(g["params"] for g in opt.param_groups) and all(g["momentum"] == 0.9 for g in opt.param_groups)

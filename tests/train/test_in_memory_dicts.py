"""A Dataset of dicts held in memory (Hugging Face style: `{"input_ids": self.ids[i], ...}`) is sliced too, into
dict batches, in the DataLoader's order; one that computes a field keeps the per-sample path. Nothing is timed."""

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, random_split

import torchspeed
from torchspeed.train.in_memory import SlicedLoader, sliced_loader


class Tokens(Dataset):
    def __init__(self, n=64, length=6, vocab=20):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, length), generator=g)
        self.mask = torch.ones(n, length, dtype=torch.long)
        self.labels = (self.ids[:, 0] > vocab // 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class Shifted(Tokens):
    def __getitem__(self, i):  # a computed field: per sample, as written
        return {"input_ids": self.ids[i] + 1, "attention_mask": self.mask[i], "labels": self.labels[i]}


class Classifier(nn.Module):
    def __init__(self, vocab=21, d=8):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        m = attention_mask.unsqueeze(-1).float()
        logits = self.head((self.emb(input_ids) * m).sum(1) / m.sum(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _loader(ds):
    return DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))


def test_a_dict_dataset_in_memory_is_sliced_into_the_dataloaders_dict_batches(monkeypatch):
    for ds in (Tokens(), random_split(Tokens(), [40, 24], generator=torch.Generator().manual_seed(1))[0]):
        got = sliced_loader(_loader(ds), torch.device("cpu"))
        assert isinstance(got, SlicedLoader) and got.keys == ("input_ids", "attention_mask", "labels")
        reads = []
        with monkeypatch.context() as m:  # a spy on per-sample reads, set after the source was read
            m.setattr(Tokens, "__getitem__", lambda self, i: reads.append(i))
            batches = list(got)
        assert reads == []
        want = list(_loader(ds))
        assert len(batches) == len(want)
        for b, w in zip(batches, want):
            assert list(b) == list(w) and all(torch.equal(b[k], w[k]) and b[k].dtype == w[k].dtype for k in w)


def test_a_dict_dataset_that_computes_a_field_is_not_sliced():
    assert type(sliced_loader(_loader(Shifted()), torch.device("cpu"))) is DataLoader


def test_fit_slices_a_dict_dataset_and_trains_on_its_batches():
    torch.manual_seed(0)
    res = torchspeed.fit(Classifier(), _loader(Tokens()), epochs=2, optimizer="adamw", lr=1e-2,
                         val_loader=DataLoader(Tokens(16), batch_size=8), progress=False, trial=False, compile=False)
    assert res.decisions["batching"].value == "index slices"
    assert "Tokens.__getitem__ only indexes its tensors" in res.decisions["batching"].reason
    assert res.steps == 16 and res.final["val_loss"] is not None


class Texts(Dataset):
    """numpy fields, one of them strings (a Hugging Face dataset's raw text beside its ids), or reversed."""

    def __init__(self, reverse=False, n=32):
        import numpy as np
        g = np.random.default_rng(0)
        ids = g.integers(1, 20, (n, 6))
        self.ids = ids[::-1] if reverse else ids  # a negative stride: torch cannot view it
        self.labels = (self.ids[:, 0] > 10).astype(np.int64)
        self.text = np.array([f"s{i}" for i in range(n)])

    def __len__(self):
        return len(self.labels)


class IdsAndText(Texts):
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i], "text": self.text[i]}


class Reversed(Texts):
    def __init__(self):
        super().__init__(reverse=True)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def test_numpy_fields_torch_cannot_view_keep_the_per_sample_path():
    """A field of strings or with a negative stride: not sliced (no error), the DataLoader's own batches."""
    import numpy as np

    for ds in (IdsAndText(), Reversed()):
        loader = DataLoader(ds, batch_size=8)  # the default collate makes a list of the strings
        assert sliced_loader(loader, torch.device("cpu")) is loader and len(next(iter(loader))["labels"]) == 8
    ok = Reversed()
    ok.ids = np.ascontiguousarray(ok.ids)  # the same data, viewable: sliced
    assert isinstance(sliced_loader(DataLoader(ok, batch_size=8), torch.device("cpu")), SlicedLoader)

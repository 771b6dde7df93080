import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from torchspeed.data import CachedDataset, FastImageFolder, SharedLRUPool, uint8_collate


class Counting(Dataset):
    """Items (uint8 image, label, extra); counts loads in shared memory (visible across workers)."""

    def __init__(self, n=24, shape=(3, 20, 20)):
        self.n, self.shape = n, shape
        self.loads = torch.zeros(n, dtype=torch.int64).share_memory_()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loads[i] += 1
        g = torch.Generator().manual_seed(i)
        x = torch.randint(0, 256, self.shape, dtype=torch.uint8, generator=g)
        return x.permute(1, 2, 0).contiguous().permute(2, 0, 1), i, {"id": np.int64(i)}


def test_items_are_identical_and_second_epoch_never_loads():
    base = Counting()
    ds = CachedDataset(base, budget_bytes=1 << 20, page_size=1024)
    first = [ds[i] for i in range(len(ds))]
    second = [ds[i] for i in range(len(ds))]
    assert base.loads.tolist() == [1] * len(ds)  # epoch 2 came from the cache: no load, no decode
    for (a, ya, da), (b, yb, db) in zip(first, second):
        assert torch.equal(a, b) and ya == yb and da["id"] == db["id"]
        assert a.stride() == b.stride()  # memory layout (HWC under a CHW view) kept
    s = ds.stats()
    assert (s.hits, s.misses, s.items, s.evictions) == (len(ds), len(ds), len(ds), 0)


def test_budget_is_never_exceeded_and_lru_evicts_oldest():
    base = Counting(n=10, shape=(3, 16, 16))  # ~800 bytes serialized -> 1 page of 1024
    budget = 4 * 1024
    ds = CachedDataset(base, budget_bytes=budget, page_size=1024)
    assert ds.pool._t["arena"].numel() <= budget
    for i in range(4):
        ds[i]
    ds[0]                      # 0 is now the most recently used; 1 the least
    ds[4]                      # evicts 1
    s = ds.stats()
    assert s.items == 4 and s.bytes_reserved <= budget and s.evictions == 1
    before = base.loads.clone()
    for i in (0, 2, 3, 4):     # all still cached
        ds[i]
    assert torch.equal(base.loads, before)
    ds[1]                      # was evicted: loads again
    assert base.loads[1] == 2
    for i in range(10):
        ds[i]
        assert ds.stats().bytes_reserved <= budget


def test_item_larger_than_budget_is_served_not_cached():
    base = Counting(n=3, shape=(3, 64, 64))
    ds = CachedDataset(base, budget_bytes=4096, page_size=1024)
    x, _, _ = ds[0]
    assert x.shape == (3, 64, 64) and ds.stats().items == 0 and ds.stats().bytes_reserved == 0


def test_shared_across_workers():
    base = Counting(n=32)
    ds = CachedDataset(base, budget_bytes=1 << 20, page_size=2048)
    for epoch in range(2):
        torch.manual_seed(epoch)
        loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                            collate_fn=lambda b: [it[1] for it in b])
        assert sorted(i for batch in loader for i in batch) == list(range(32))
    # epoch 2 was shuffled differently, so workers read items the *other* worker cached
    assert base.loads.tolist() == [1] * 32
    s = ds.stats()
    assert s.hits == 32 and s.misses == 32


def test_encoded_mode_caches_file_bytes(photo_folder):
    base = FastImageFolder(photo_folder, size=16, crop="random")
    reads = []
    orig = base.read
    base.read = lambda i: reads.append(i) or orig(i)
    ds = CachedDataset(base, budget_bytes=1 << 22, mode="encoded")
    for _ in range(2):
        for i in range(len(ds)):
            x, y = ds[i]
            assert x.shape == (3, 16, 16) and y == base.targets[i]
    assert sorted(reads) == list(range(len(ds)))  # each file read from disk once
    assert ds.stats().hits == len(ds)


def test_refuses_to_freeze_random_crops(photo_folder):
    with pytest.raises(ValueError, match="freeze"):
        CachedDataset(FastImageFolder(photo_folder, size=16, crop="random"), budget_bytes=1 << 20)


def test_decoded_images_with_transform_after_cache(photo_folder):
    base = FastImageFolder(photo_folder, size=20, crop="center")
    ds = CachedDataset(base, budget_bytes=1 << 22, transform=lambda x: x.flip(-1))
    for _ in range(2):
        for i in (0, 5):
            torch.testing.assert_close(ds[i][0], base[i][0].flip(-1))
    assert ds.classes == base.classes  # attributes pass through


def test_pool_rejects_tiny_budget():
    with pytest.raises(ValueError, match="smaller than one page"):
        SharedLRUPool(4, 100, page_size=1024)


def test_loader_with_collate(photo_folder):
    base = FastImageFolder(photo_folder, size=16, crop="center")
    ds = CachedDataset(base, budget_bytes=1 << 22)
    first = list(DataLoader(ds, batch_size=8, collate_fn=uint8_collate))
    assert ds.stats().items == len(ds) and ds.stats().misses == len(ds)  # the first epoch filled the cache
    second = list(DataLoader(ds, batch_size=8, collate_fn=uint8_collate))
    assert ds.stats().hits == len(ds)  # the second epoch read it back
    for (a, ya), (b, yb) in zip(first, second):
        assert torch.equal(a, b) and torch.equal(ya, yb)


def test_spawned_workers_share_the_pool(photo_folder):
    ds = CachedDataset(FastImageFolder(photo_folder, size=16, crop="center"), budget_bytes=1 << 22)
    for epoch in range(2):
        loader = DataLoader(ds, batch_size=6, num_workers=2, multiprocessing_context="spawn",
                            collate_fn=uint8_collate)
        assert sum(len(y) for _, y in loader) == len(ds)
    s = ds.stats()
    assert s.misses == len(ds) and s.hits == len(ds)  # epoch 2: every item from the pool the workers filled

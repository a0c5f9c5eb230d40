"""BlendedDataset proportions and lookups, the DP-size-independent sampler, and collate."""
import numpy as np
import pytest
import torch

from pretrain.data import BlendedDataset, GlobalBatchSampler, collate
from pretrain.data.blend import apportion


class Numbers:
    """A stand-in dataset: sample k of dataset `tag` is the pair (tag, k)."""

    def __init__(self, tag):
        self.name = f"numbers-{tag}"
        self.tag = tag

    def __getitem__(self, k):
        return (self.tag, k)

    def get_many(self, ks):
        ks = np.asarray(ks)
        return np.stack([np.full(len(ks), self.tag), ks], 1), np.zeros((len(ks), 2), np.int32)


def test_apportion_is_exact_and_stable():
    assert apportion([1, 1, 1], 10).tolist() == [4, 3, 3]  # ties go to the earlier entry
    assert apportion([0.7, 0.2, 0.1], 16384).sum() == 16384
    assert apportion([3, 1], 8).tolist() == [6, 2]


@pytest.mark.parametrize("weights, block", [([0.5, 0.3, 0.2], 100), ([1, 1, 5], 7), ([2.0], 5)])
def test_blend_proportions_hold_in_every_window_of_a_block(weights, block):
    blend = BlendedDataset([(w, Numbers(t)) for t, w in enumerate(weights)], block_size=block)
    counts = apportion(weights, block)
    src = [blend[i] for i in range(5 * block)]
    tags = np.array([s[0] for s in src])
    for start in range(0, 4 * block):  # any B consecutive samples hold exactly the block's counts
        np.testing.assert_array_equal(np.bincount(tags[start : start + block], minlength=len(weights)), counts)
    for t in range(len(weights)):  # each child is read in order, every sample once
        assert [k for tag, k in src if tag == t] == list(range(5 * counts[t]))
    d, k = blend.sources(np.arange(5 * block))
    assert list(zip(d.tolist(), k.tolist())) == src
    tokens, _ = blend.get_many(np.arange(3 * block)[::-1])
    assert [tuple(r) for r in tokens.tolist()] == src[: 3 * block][::-1]


def test_blend_refuses_bad_weights():
    with pytest.raises(ValueError, match="at least one"):
        BlendedDataset([])
    with pytest.raises(ValueError, match=r"dataset 1 \(numbers-1\) has weight 0.0"):
        BlendedDataset([(1.0, Numbers(0)), (0.0, Numbers(1))])
    with pytest.raises(ValueError, match=r"dataset 1 \(numbers-1\) .* gets no sample in a block of 100"):
        BlendedDataset([(1.0, Numbers(0)), (1e-4, Numbers(1))], block_size=100)
    with pytest.raises(IndexError, match="negative"):
        BlendedDataset([(1.0, Numbers(0))])[-1]


def global_batches(G, m, D, consumed, steps):
    """The global batches the D ranks see together, each as the ranks' micro batches in rank order."""
    samplers = [GlobalBatchSampler(G, m, r, D, consumed) for r in range(D)]
    out = []
    for g in range(steps):
        batch = []
        for s in samplers:
            for micro in s.micro_batches(g):
                assert len(micro) == m
                batch.extend(micro)
        out.append(batch)
    return out


@pytest.mark.parametrize("D, m", [(1, 1), (1, 8), (2, 2), (4, 1), (4, 2), (8, 1)])
def test_global_batches_do_not_depend_on_the_layout(D, m):
    expected = [list(range(g * 8, (g + 1) * 8)) for g in range(5)]
    assert global_batches(8, m, D, 0, 5) == expected


def test_resume_from_consumed_samples_on_another_layout():
    uninterrupted = global_batches(16, 2, 4, 0, 6)
    resumed = global_batches(16, 8, 1, consumed=3 * 16, steps=3)  # resumed at step 3 on one rank
    assert resumed == uninterrupted[3:]
    # The global batch size may change at a resume: it continues from the consumed count.
    bigger = global_batches(32, 4, 2, consumed=3 * 16, steps=2)
    assert sum(bigger, []) == list(range(48, 112))


def test_sampler_iterates_rank_slices_and_stops_at_total():
    s = GlobalBatchSampler(8, 2, 1, 2, consumed_samples=4, total_samples=4 + 8 * 3 + 5)
    batches = list(s)
    assert len(batches) == len(s) == 3 * 2
    assert batches[:2] == [[8, 9], [10, 11]]  # rank 1 takes the second half of [4, 12)
    with pytest.raises(TypeError, match="no length"):
        len(GlobalBatchSampler(8, 2, 0, 2))


@pytest.mark.parametrize(
    "args, message",
    [
        ((10, 2, 0, 3), "not divisible by micro_batch_size \\* dp_size = 2 \\* 3 = 6"),
        ((8, 2, 2, 2), "dp_rank 2 is out of range"),
        ((0, 1, 0, 1), "must be positive"),
        ((8, 1, 0, 1, -1), "consumed_samples must be non-negative"),
    ],
)
def test_sampler_refuses_bad_layouts(args, message):
    with pytest.raises(ValueError, match=message):
        GlobalBatchSampler(*args)
    with pytest.raises(TypeError, match="global_batch_size must be an integer"):
        GlobalBatchSampler(8.0, 1, 0, 1)


def test_collate_shifts_masks_and_restarts_positions():
    EOD = 2
    # Two documents: [5 6 7 EOD] then [8 9 ...]; sample of seq_len + 1 = 7 tokens.
    tokens = np.array([[5, 6, 7, EOD, 8, 9, 10]])
    doc_ids = np.array([[0, 0, 0, 0, 1, 1, 1]], np.int32)
    b = collate((tokens, doc_ids), eod_id=EOD)
    assert b.tokens.tolist() == [[5, 6, 7, EOD, 8, 9]] and b.labels.tolist() == [[6, 7, EOD, 8, 9, 10]]
    assert b.tokens.dtype == torch.int64 and b.doc_ids.dtype == torch.int32 and b.loss_mask.dtype == torch.bool
    assert b.loss_mask.tolist() == [[True, True, True, False, True, True]]  # EOD -> next doc's first token
    assert b.positions.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert b.doc_ids.tolist() == [[0, 0, 0, 0, 1, 1]]
    plain = collate([{"tokens": tokens[0], "doc_ids": doc_ids[0]}], eod_id=EOD, reset_positions=False,
                    mask_cross_document=False)
    assert plain.positions.tolist() == [[0, 1, 2, 3, 4, 5]] and plain.loss_mask.all()
    # Without an EOD token between documents the boundary is still masked through doc_ids.
    no_eod = collate((np.array([[5, 6, 8, 9]]), np.array([[0, 0, 1, 1]])), eod_id=None)
    assert no_eod.loss_mask.tolist() == [[True, False, True]]
    padded = collate((np.array([[5, 6, 0, 0]]), np.zeros((1, 4), np.int32)), eod_id=None, pad_id=0)
    assert padded.loss_mask.tolist() == [[True, False, False]]
    # a pad input before a real token trains nothing either (spec-001 §2.4: valid = idx != PAD and idx != EOS)
    pad_input = collate((np.array([[5, 0, 7, 8]]), np.zeros((1, 4), np.int32)), eod_id=None, pad_id=0)
    assert pad_input.loss_mask.tolist() == [[False, False, True]]


def test_collate_refuses_bad_shapes():
    with pytest.raises(ValueError, match="empty list"):
        collate([], eod_id=None)
    with pytest.raises(ValueError, match="one shape"):
        collate((np.zeros((2, 5)), np.zeros((2, 4))), eod_id=None)


def test_collate_of_a_packed_dataset_batch(tmp_path):
    from data_tools.indexed import IndexedWriter
    from pretrain.data import Collator, PackedDataset

    rng = np.random.default_rng(0)
    with IndexedWriter(tmp_path / "d", np.uint16) as w:
        for n in rng.integers(1, 12, 80):
            w.add_document(np.append(rng.integers(10, 100, n - 1), 2))  # each doc ends with EOD 2
    ds = PackedDataset(str(tmp_path / "d"), 16, split="1", cache_dir=tmp_path / "c")
    batch = Collator(eod_id=2)(ds.get_many(range(8)))
    assert batch.tokens.shape == batch.positions.shape == (8, 16)
    # Inputs equal to EOD are exactly the positions whose target starts a new document.
    eod_inputs = batch.tokens == 2
    assert torch.equal(~batch.loss_mask, eod_inputs)
    starts = batch.positions == 0
    assert torch.equal(starts[:, 1:], eod_inputs[:, :-1])


def test_dataloader_workers_see_the_same_batches(tmp_path):
    from torch.utils.data import DataLoader

    from data_tools.indexed import IndexedWriter
    from pretrain.data import Collator, PackedDataset

    rng = np.random.default_rng(1)
    children = []
    for name in ("web", "code"):
        with IndexedWriter(tmp_path / name, np.uint16) as w:
            for n in rng.integers(1, 40, 120):
                w.add_document(np.append(rng.integers(10, 100, n - 1), 2))
        children.append(PackedDataset(str(tmp_path / name), 12, split="1", cache_dir=tmp_path / "c"))
    blend = BlendedDataset([(0.7, children[0]), (0.3, children[1])], block_size=10)
    sampler = GlobalBatchSampler(8, 2, dp_rank=1, dp_size=2, consumed_samples=16, total_samples=48)
    loader = DataLoader(blend, batch_sampler=sampler, collate_fn=Collator(eod_id=2), num_workers=2)
    batches = list(loader)
    assert len(batches) == len(sampler) == 8
    for got, indices in zip(batches, sampler):
        want = Collator(eod_id=2)([blend[i] for i in indices])
        for field in ("tokens", "labels", "loss_mask", "doc_ids", "positions"):
            assert torch.equal(getattr(got, field), getattr(want, field))

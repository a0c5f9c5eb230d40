"""Pointer chasing (spec-000 4.10, checks 6.10 and 6.11) and the synthetic-task data path.

The structure tests read the generated tokens back as text (v3, k1_2, =, Q, ||, ?) and parse the
tables themselves, so they check the layout and the answers independently of the generator's own
bookkeeping. The run tests go through the real CLI and trainer.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kernels.attention.reference import allowed_mask
from pretrain.config import ConfigError, load_config
from pretrain.tasks import TaskCollator, TaskDataset, evaluate_accuracy, get_task, task_names
from pretrain.tasks.pointer_chasing import Layout, PointerChasingConfig, accuracy_per_level, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def names(cfg, tokens):
    lay = Layout(cfg)
    return [lay.name(int(t)) for t in tokens]


def sections(words):
    """The ||-separated sections, each a list of words (the final query has no trailing ||)."""
    out, cur = [], []
    for w in words:
        if w == "||":
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    return out + [cur]


def resolve(words, hops):
    """{key: value} for every key of every level, by following the tables written in the sequence."""
    secs = sections(words)
    value = {}
    for s in secs[0::2][: hops + 1]:  # tables are the even sections
        for left, eq, right in zip(s[0::3], s[1::3], s[2::3]):
            assert eq == "="
            value[right] = left if left.startswith("v") else value[left]
    return value


@pytest.mark.parametrize("H,M,length", [(2, 3, 52), (10, 5, 338), (20, 5, 658), (1, 2, 23), (3, 3, 72), (4, 7, 200)])
def test_lengths(H, M, length):
    cfg = PointerChasingConfig(hops=H, keys=M, values=max(M, 10))
    assert H * (6 * M + 2) + 3 * M + 3 == length
    assert (2 * H + 1) * (3 * M + 1) + 2 == length  # H+1 tables and H query sections of M triplets and ||, `Q kH_q`
    assert get_task("pointer_chasing").seq_len(cfg) == length
    s = generate(cfg, 3, seed=0)
    assert s.tokens.shape == s.targets.shape == s.levels.shape == (3, length)


def test_vocabulary_is_the_spec_count():
    assert Layout(PointerChasingConfig(hops=10, keys=5, values=10)).vocab_size == 68
    assert Layout(PointerChasingConfig(hops=10, keys=5, values=10, answers_in_input=False)).vocab_size == 69
    s = generate(PointerChasingConfig(hops=10, keys=5, values=10), 20, seed=1)
    assert s.tokens.min() >= 0 and s.tokens.max() < 68


@pytest.mark.parametrize("seed", range(5))
def test_worked_example_structure(seed):
    """(H, M) = (2, 3): table 0, queries 0, table 1, queries 1, table 2, final query."""
    cfg = PointerChasingConfig(hops=2, keys=3, values=10)
    s = generate(cfg, 1, seed)
    words = names(cfg, s.tokens[0])
    secs = sections(words)
    assert [len(x) for x in secs] == [9, 9, 9, 9, 9, 2]
    table0 = secs[0]
    assert table0[1::3] == ["="] * 3 and table0[2::3] == ["k0_0", "k0_1", "k0_2"]  # reversed, in key order
    assert all(v.startswith("v") for v in table0[0::3])
    assert len(set(table0[0::3])) == 3  # distinct values
    value = resolve(words, 2)
    for level in (1, 2):
        table = secs[2 * level]
        assert table[2::3] == [f"k{level}_{j}" for j in range(3)] and table[1::3] == ["="] * 3
        assert sorted(table[0::3]) == [f"k{level - 1}_{j}" for j in range(3)]  # a permutation of the level below
    for level in (0, 1):
        q = secs[2 * level + 1]
        assert q[0::3] == ["Q"] * 3 and q[1::3] == [f"k{level}_{j}" for j in range(3)]
        assert q[2::3] == [value[k] for k in q[1::3]]  # literal encoding: the answer follows the key
    assert secs[-1][0] == "Q" and secs[-1][1].startswith("k2_")


@pytest.mark.parametrize("H,M,answers", [(2, 3, True), (10, 5, True), (4, 3, False)])
def test_targets_sit_only_at_query_keys_and_resolve_through_the_chain(H, M, answers):
    cfg = PointerChasingConfig(hops=H, keys=M, values=10, answers_in_input=answers)
    s = generate(cfg, 8, seed=H)
    lay = Layout(cfg)
    for tokens, targets, levels in zip(*s):
        words = names(cfg, tokens)
        query_keys = [t for t in range(1, len(words)) if words[t - 1] == "Q"]
        assert list(np.flatnonzero(targets >= 0)) == query_keys
        assert query_keys[-1] == len(words) - 1  # the last position's label is the final answer
        assert list(np.flatnonzero(levels >= 0)) == query_keys
        value = resolve(words, H)
        for t in query_keys:
            key = words[t]
            assert levels[t] == int(key[1 : key.index("_")])
            assert lay.name(targets[t]) == value[key]
        counts = np.bincount(levels[levels >= 0], minlength=H + 1)
        assert list(counts) == [M] * H + [1]
        if answers:  # literal: targets are next-token labels
            assert all(targets[t] == tokens[t + 1] for t in query_keys[:-1])


def test_level_zero_values_are_distinct_and_drawn_from_all_values():
    cfg = PointerChasingConfig(hops=1, keys=5, values=6)
    s = generate(cfg, 300, seed=3)
    table = s.tokens[:, 0:15:3]  # the values of `v = k0_j`
    assert all(len(set(row)) == 5 for row in table)
    assert set(np.unique(table)) == set(range(6))


def test_window_38_hides_the_base_table_from_level_2_queries():
    """(10, 5): the level-0 table is positions 0..15 (|| included); with a window of 38 keys a level >= 2
    query key (the earliest at 81, seeing 44..81) sees none of it, while level-1 queries still do."""
    cfg = PointerChasingConfig(hops=10, keys=5, values=10)
    s = generate(cfg, 1, seed=0)
    levels = s.levels[0]
    base_end = names(cfg, s.tokens[0]).index("||")
    assert base_end == 15
    mask = allowed_mask(338, 338, window=38)[0, 0]
    level2 = np.flatnonzero(levels >= 2)
    assert level2.min() == 81 and level2.min() - 38 + 1 == 44
    assert not mask[level2][:, : base_end + 1].any()
    assert mask[np.flatnonzero(levels == 1)][:, : base_end + 1].any()  # the check has teeth


def test_hidden_answers_never_appear_in_the_input():
    """answers_in_input=False: the same draws as the literal encoding, with `?` where answers stood."""
    hidden = PointerChasingConfig(hops=5, keys=4, values=12, answers_in_input=False)
    literal = PointerChasingConfig(hops=5, keys=4, values=12)
    h, lit = generate(hidden, 10, seed=7), generate(literal, 10, seed=7)
    assert np.array_equal(h.targets, lit.targets) and np.array_equal(h.levels, lit.levels)
    table0 = np.zeros(h.tokens.shape[1], dtype=bool)
    table0[: 3 * 4] = True
    for tokens, targets in zip(h.tokens, h.targets):
        words = names(hidden, tokens)
        query_keys = np.flatnonzero(targets >= 0)
        assert all(words[t + 1] == "?" for t in query_keys[:-1])
        is_value = tokens < 12
        assert not is_value[~table0].any()  # values only in the level-0 table, never as an answer
    differs = h.tokens != lit.tokens
    assert np.array_equal(differs[0], np.isin(np.arange(h.tokens.shape[1]), np.flatnonzero(h.targets[0] >= 0)[:-1] + 1))


def test_generation_is_deterministic_per_seed():
    cfg = PointerChasingConfig(hops=3, keys=3, values=10)
    a, b, c = generate(cfg, 16, 5), generate(cfg, 16, 5), generate(cfg, 16, 6)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a.tokens, c.tokens)
    # the trainer's streams: sample i is a pure function of (seed, i); train and held-out differ
    first, again = TaskDataset("pointer_chasing", cfg, 1234), TaskDataset("pointer_chasing", cfg, 1234)
    for i in (0, 1, 999):
        assert np.array_equal(first[i].tokens, again[i].tokens)
    assert not np.array_equal(first[0].tokens, first[1].tokens)
    assert not np.array_equal(first[0].tokens, TaskDataset("pointer_chasing", cfg, 1235)[0].tokens)
    assert not np.array_equal(first[0].tokens, TaskDataset("pointer_chasing", cfg, None)[0].tokens)


def test_collator_puts_the_loss_at_the_targets():
    cfg = PointerChasingConfig(hops=2, keys=3, values=10)
    samples = TaskDataset("pointer_chasing", cfg, 0).get_many(range(4))
    batch = TaskCollator()(samples)
    targets = np.stack([s.targets for s in samples])
    assert batch.tokens.shape == (4, 52) and torch.equal(batch.tokens, torch.from_numpy(np.stack([s.tokens for s in samples])))
    assert torch.equal(batch.loss_mask, torch.from_numpy(targets >= 0))
    assert torch.equal(batch.labels[batch.loss_mask], torch.from_numpy(targets[targets >= 0]))
    assert torch.equal(batch.positions[1], torch.arange(52)) and not batch.doc_ids.any()


class Oracle(torch.nn.Module):
    """Logits that answer every level right except `wrong_level` (answered with the value + 1)."""

    def __init__(self, cfg, wrong_level):
        super().__init__()
        self.cfg, self.wrong_level = cfg, wrong_level


def oracle_logits(model, tokens):
    cfg = model.cfg
    lay = Layout(cfg)
    out = torch.zeros(*tokens.shape, lay.vocab_size)
    for b, row in enumerate(tokens.tolist()):
        words = [lay.name(t) for t in row]
        value = resolve(words, cfg.hops)
        for t in range(1, len(words)):
            if words[t - 1] == "Q":
                answer = int(value[words[t]][1:])
                if int(words[t][1 : words[t].index("_")]) == model.wrong_level:
                    answer = (answer + 1) % cfg.values
                out[b, t, answer] = 1.0
    return out


def test_accuracy_is_reported_per_level():
    cfg = PointerChasingConfig(hops=3, keys=3, values=10)
    held_out = TaskDataset("pointer_chasing", cfg, None)
    result = evaluate_accuracy(Oracle(cfg, wrong_level=2), oracle_logits, held_out, 10, 4, torch.device("cpu"))
    assert result == {"val_acc_L0": 1.0, "val_acc_L1": 1.0, "val_acc_L2": 0.0, "val_acc_L3": 1.0}
    s = generate(cfg, 6, 0)
    predictions = np.where(s.levels == 3, (s.targets + 1) % 10, s.targets)
    assert list(accuracy_per_level(predictions, s.targets, s.levels, 3)) == [1.0, 1.0, 1.0, 0.0]


TINY = ["train.threads=1", "train.log_every=5", "checkpoint.every=0"]


@pytest.mark.parametrize("overrides, message", [
    (["data.task_params.hops=0"], "data.task_params.hops must be at least 1, got 0"),
    (["data.task_params.keys=1"], "data.task_params.keys must be at least 2"),
    (["data.task_params.values=2"], "data.task_params.values 2 must be at least data.task_params.keys 3"),
    (["model.vocab_size=24"], "model.vocab_size 24 is smaller than the pointer_chasing vocabulary of 25 tokens"),
    (["data.task_params.answers_in_input=false", "model.vocab_size=25"],
     "model.vocab_size 25 is smaller than the pointer_chasing vocabulary of 26 tokens"),
    (["data.seq_len=64"], "data.seq_len 64 must equal the pointer_chasing sequence length 72"),
    (["data.task=sorting"], "data.task 'sorting' is not a known task; choose one of associative_recall, pointer_chasing"),
    (["data.train=[x]"], "data.train must be empty with data.task=pointer_chasing"),
    (["data.task_params.hopz=2"], "Key 'hopz' not in 'PointerChasingConfig'"),
])
def test_bad_input_is_refused_in_one_sentence(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config("pointer_chasing/tiny", overrides)
    assert "\n" not in str(e.value)


def test_task_params_without_a_task_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {arch: baseline}\ndata: {train: [x], task_params: {hops: 2}}\n")
    with pytest.raises(ConfigError, match="data.task_params is set but data.task is empty"):
        load_config(str(path), check_data=False)
    assert "pointer_chasing" in task_names()


def test_shipped_recipes_fit_their_task():
    for name in ("pointer_chasing/tiny", "pointer_chasing/paper-roformer"):
        cfg = load_config(name)
        assert cfg.data.seq_len == get_task("pointer_chasing").seq_len(cfg.data.task_params)
    paper = load_config("pointer_chasing/paper-roformer")
    p = paper.data.task_params
    assert (p.hops, p.keys, p.values, paper.model.window, paper.model.d_model, paper.model.n_heads) == (10, 5, 10, 38, 256, 4)
    assert (paper.train.global_batch_seqs, paper.optim.lr, paper.data.seq_len) == (64, 1e-4, 338)


def run_cli(cwd, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, "-m", "pretrain.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=600)


def test_tiny_run_trains_and_eval_reports_per_level_accuracy(tmp_path):
    train = run_cli(tmp_path, "train", "pointer_chasing/tiny", "train.max_steps=90", "train.eval_every=45", *TINY)
    assert train.returncode == 0, train.stderr
    run = tmp_path / "runs" / "pc-tiny"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert losses[-1] < 0.8 * losses[0], losses  # the loss falls
    last = records[-1]
    assert {f"val_acc_L{i}" for i in range(4)} <= set(last)
    assert last["val_acc_L0"] > 0.5  # a plain lookup is learned first (chance is 1/3)
    assert "accuracy L0" in train.stdout
    ev = run_cli(tmp_path, "eval", str(run))
    assert ev.returncode == 0, ev.stderr
    line = [x for x in ev.stdout.splitlines() if x.startswith("pointer_chasing accuracy")]
    assert len(line) == 1 and all(f"L{i} " in line[0] for i in range(4)), ev.stdout
    # the same held-out sequences as the evaluation at the end of training
    assert f"L0 {last['val_acc_L0']:.3f}" in line[0]
    js = run_cli(tmp_path, "eval", str(run), "--json", "--batches", "1")
    assert js.returncode == 0, js.stderr
    assert set(json.loads(js.stdout.strip().splitlines()[-1])) >= {"val_loss", "val_acc_L0", "val_acc_L3"}


def test_resume_reads_the_same_samples(tmp_path):
    """Stop after 4 steps and resume to 8: every step's loss equals the uninterrupted run's, bit for bit
    (the samples are a pure function of data.seed and the consumed-sample count)."""
    from pretrain.trainer import Trainer

    def losses(run):
        return [json.loads(x)["loss"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    def fit(run, steps):
        over = ["train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.threads=1",
                "checkpoint.every=0", "train.global_batch_seqs=8", "train.micro_batch_seqs=4", "model.n_layers=1",
                f"train.run_dir={tmp_path / run}", f"train.max_steps={steps}", "schedule.warmup_steps=1"]
        Trainer(load_config("pointer_chasing/tiny", over), log=lambda *_: None).fit()

    fit("whole", 8)
    fit("split", 4)
    fit("split", 8)
    assert len(losses("whole")) == 8
    assert losses("split") == losses("whole")

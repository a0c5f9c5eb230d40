"""The house's seams, shown by a test architecture with a mask of its own (tests/prefix_lm_model.py):
it registers, trains through the trainer and decodes exactly with no edit outside its file. The
registry-wide tests (test_registry.py imports it) hold it to the streaming-decode relation too."""
import os
import subprocess

import pytest
import torch

import prefix_lm_model
from pretrain.config import load_config
from pretrain.metrics import read_metrics
from pretrain.models import get_arch
from pretrain.trainer import Trainer
from trainer_helpers import VOCAB, tiny_overrides, write_markov_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model(prefix=4, seed=0):
    cfg = prefix_lm_model.PrefixLMConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
                                         prefix=prefix)
    torch.manual_seed(seed)
    return get_arch("test_prefix_lm").build(cfg).double().eval()


def test_prefix_positions_see_each_other_and_later_ones_stay_causal():
    m = model()
    tokens = torch.randint(5, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = m.logits(tokens)
        in_prefix, after = tokens.clone(), tokens.clone()
        in_prefix[:, 3] = (in_prefix[:, 3] + 1) % VOCAB  # the prefix's last token
        after[:, 6] = (after[:, 6] + 1) % VOCAB
        changed_prefix, changed_after = m.logits(in_prefix), m.logits(after)
    assert not torch.allclose(changed_prefix[:, 0], base[:, 0])  # position 0 reads position 3: both ways
    torch.testing.assert_close(changed_after[:, :6], base[:, :6], rtol=0, atol=0)  # causal after the prefix
    assert not torch.allclose(changed_after[:, 6:], base[:, 6:])
    with torch.no_grad():  # prefix 0 is the causal decoder: the same weights give the baseline's function
        causal = model(prefix=0)
        causal.load_state_dict(m.state_dict())
        baseline = get_arch("baseline").build(get_arch("baseline").config_cls(
            **{k: v for k, v in causal.cfg.__dict__.items() if k not in ("arch", "prefix")})).double()
        baseline.load_state_dict(m.state_dict())
        torch.testing.assert_close(causal.logits(tokens), baseline.logits(tokens), rtol=0, atol=0)


def test_decode_equals_the_parallel_forward_and_a_short_first_step_is_refused():
    m, spec = model(), get_arch("test_prefix_lm")
    tokens = torch.randint(5, VOCAB, (3, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = spec.logits(m, tokens)
        state = spec.new_state(m, 3)
        pieces = [spec.step(m, tokens[:, :4], state)[0]]  # exactly the prefix, then one by one
        pieces += [spec.step(m, tokens[:, t:t + 1], state)[0] for t in range(4, 12)]
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-10)
        with pytest.raises(ValueError, match="must feed the whole prefix of model.prefix=4 tokens"):
            spec.step(m, tokens[:, :2], spec.new_state(m, 3))


def test_trains_through_the_trainer(tmp_path):
    corpus = write_markov_corpus(tmp_path / "markov")
    over = tiny_overrides(tmp_path, corpus, **{"model.arch": "test_prefix_lm", "train.max_steps": 8,
                                                "train.eval_every": 4, "checkpoint.every": 0, "train.compile": "false"})
    lines = []
    Trainer(load_config("baseline/tiny", over), log=lines.append).fit()
    records = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] and "val_loss" in records[-1]
    assert "kernels: attention sdpa, lm_loss reference, rms_norm torch" in lines  # its mask is no causal one: SDPA, explicit mask


def test_nothing_outside_its_file_names_it():
    found = subprocess.run(["git", "grep", "-l", "-i", "prefix_lm", "--", "pretrain", "parallel", "kernels",
                            "data_tools", "configs", "slurm"], cwd=ROOT, capture_output=True, text=True)
    assert found.returncode in (0, 1) and found.stdout == ""

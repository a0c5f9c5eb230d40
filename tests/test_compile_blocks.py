"""train.compile_scope=blocks (Decoder.compile_blocks, parallel/apply.py): each distinct block compiled on its
own and the read-out apart. The compiled model gives the eager loss and gradients; the number of graphs
dynamo compiles does not grow with depth (blocks of one class share one graph: that is what makes it compile
in about one block's time); RT's recurrent layers stay out; CRT and GPN keep their own `compile`; the field is
checked and reaches the trainer."""
import re

import pytest
import torch

from pretrain.config import load_config
from pretrain.data.batch import Batch
from pretrain.models import get_arch
from pretrain.models.base import StepContext
from pretrain.run_config import ConfigError


def model_and_batch(config: str, overrides=(), B: int = 2):
    cfg = load_config(config, list(overrides), check_data=False)
    torch.manual_seed(0)
    model = get_arch(cfg.model.arch).build(cfg.model).train()
    T = cfg.data.seq_len
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(5, cfg.model.vocab_size, (B, T), generator=g)
    doc_ids = (torch.arange(T) >= T // 2).int().expand(B, T).contiguous()  # two packed documents
    positions = torch.arange(T) - (T // 2) * doc_ids
    batch = Batch(tokens, torch.roll(tokens, -1, 1), torch.ones(B, T, dtype=torch.bool), doc_ids, positions)
    return model, batch


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(batch, StepContext.for_step(0, 0))[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("config", ["baseline/tiny", "sps/tiny", "cart/tiny"])
def test_blocks_compiled_apart_give_the_eager_loss_and_gradients(config):
    """Inductor on the baseline (the code a GPU runs); aot_eager (the traced forward and backward graphs,
    without code generation) on SPS's slots and CART's shared loop blocks, to keep CI short."""
    eager, batch = model_and_batch(config)
    compiled, _ = model_and_batch(config)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled.compile_blocks(backend="inductor" if config.startswith("baseline") else "aot_eager")
    want_loss, want = loss_and_grads(eager, batch)
    got_loss, got = loss_and_grads(compiled, batch)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before >= 2  # the blocks and the read-out compiled
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def compiled_graphs(layers: int) -> int:
    model, batch = model_and_batch("baseline/tiny", [f"model.n_layers={layers}"])
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the counters outlive dynamo.reset
    model.compile_blocks(backend="eager")
    loss_and_grads(model, batch)
    count = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()
    return count


def test_the_graphs_compiled_do_not_grow_with_depth():
    """Whole-model compile traces every layer into one graph; compiled apart, the second and later blocks reuse
    the first block's graph, so 2 and 6 layers compile the same graphs."""
    two, six = compiled_graphs(2), compiled_graphs(6)
    assert two == six >= 2, (two, six)


def test_rts_recurrent_layers_stay_out_and_its_transformer_rows_compile_by_block():
    recurrent, _ = model_and_batch("rt/tiny")
    recurrent.compile_blocks(backend="eager")
    assert not any(b._compiled_call_impl for b in recurrent.blocks)
    rows, batch = model_and_batch("rt/tiny", ["model.recurrent=false"])
    eager, _ = model_and_batch("rt/tiny", ["model.recurrent=false"])
    rows.compile_blocks(backend="aot_eager")
    torch.testing.assert_close(loss_and_grads(rows, batch)[0], loss_and_grads(eager, batch)[0], rtol=1e-5, atol=1e-6)
    assert all(b._compiled_call_impl is not None for b in rows.blocks)


def test_crt_and_gpn_keep_their_own_compile_under_blocks(monkeypatch):
    """Their `compile` already compiles pieces (CRT one pass, GPN its step): under blocks they run it (CRT's
    compile_blocks is its compile; GPN has none, and parallelize falls back to compile)."""
    from parallel.apply import parallelize
    from parallel.engine import EngineSettings

    for arch in ("crt", "gpn"):
        cfg = load_config(f"{arch}/tiny", ["train.compile_scope=blocks"], check_data=False)
        calls = []
        monkeypatch.setattr(type(get_arch(arch).build(cfg.model)), "compile", lambda self, **kw: calls.append(arch))
        parallelize(lambda: get_arch(arch).build(cfg.model), EngineSettings.from_run(cfg),
                    lambda m: torch.optim.SGD(m.parameters(), lr=0.1), compile=True, compile_scope="blocks")
        assert calls == [arch]


def test_the_field_is_checked_and_reaches_the_start_line(tmp_path):
    """A compiled tiny run block by block: its start line says so, its blocks are the compiled ones, and it
    trains to the eager run's losses."""
    from pretrain.metrics import read_metrics
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides, write_markov_corpus

    with pytest.raises(ConfigError, match=r"train.compile_scope must be one of model, blocks, got 'layers'"):
        load_config("baseline/tiny", ["train.compile_scope=layers"], check_data=False)
    corpus = write_markov_corpus(tmp_path / "corpus" / "markov", num_docs=40)
    losses = {}
    for scope, compiled in (("blocks", "true"), ("model", "false")):
        over = tiny_overrides(tmp_path / scope, corpus, **{"train.max_steps": 3, "train.eval_every": 0,
                                                           "checkpoint.every": 10,
                                                           "schedule.warmup_steps": 0})
        cfg = load_config("baseline/tiny", over + [f"train.compile={compiled}", f"train.compile_scope={scope}"])
        lines = []
        trainer = Trainer(cfg, log=lines.append)
        if scope == "blocks":
            assert all(b._compiled_call_impl is not None for b in trainer.model.blocks)
            assert trainer.model._compiled_call_impl is None  # not the whole model
        trainer.fit()
        said = [ln for ln in lines if ln.startswith("compile: ")]  # where the first step went (compile_report)
        if scope == "blocks":
            assert any("compiling the model (train.compile_scope=blocks)" in ln for ln in lines), lines
            assert len(said) == 1 and re.fullmatch(r"compile: [\d.]+ s by step 1: dynamo [\d.]+ s, the forward [\d.]+ s"
                                                   r"(, the backward [\d.]+ s)?(; waiting .*)?", said[0]), lines  # (a cached backward: loaded with the forward)
        else:
            assert not said, said
        losses[scope] = [r["loss"] for r in read_metrics(cfg.train.run_dir) if "loss" in r]
    assert losses["blocks"] == pytest.approx(losses["model"], rel=1e-4), losses


def test_a_shorter_last_evaluation_batch_runs_eagerly_instead_of_compiling_again():
    """A small validation set ends in a shorter batch: run eagerly, not compiled for a shape seen once per
    evaluation (a whole-model compile on a GPU takes about a minute), with the same loss."""
    import numpy as np

    from pretrain.data.batch import collate
    from pretrain.trainer import evaluate_loss

    class Samples:
        def __init__(self, n, T, V):
            self.rows = np.random.default_rng(0).integers(5, V, (n, T + 1))

        def get_many(self, indices):
            return [self.rows[i] for i in indices]

    def collated(samples):
        rows = np.stack(samples)
        return collate((rows, rows * 0), eod_id=None)

    eager, _ = model_and_batch("baseline/tiny")
    compiled, _ = model_and_batch("baseline/tiny")
    compiled.compile(backend="aot_eager")
    data = Samples(5, 16, load_config("baseline/tiny", check_data=False).model.vocab_size)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = evaluate_loss(compiled, data, 5, 2, collated, torch.device("cpu"))  # batches of 2, 2 and 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1  # the full batches' graph only
    want = evaluate_loss(eager, data, 5, 2, collated, torch.device("cpu"))
    assert got["val_tokens"] == want["val_tokens"] == 5 * 16
    assert abs(got["val_loss"] - want["val_loss"]) < 1e-5


# What `train.compile` compiles of each architecture (its `compile`), and RT's Transformer rows, which compile whole
COMPILED = [f"{arch}/tiny" for arch in ("baseline", "sps", "cart", "crt", "rt", "gpn")] + ["rt/tiny recurrent=false"]


@pytest.mark.parametrize("config", COMPILED)
def test_what_train_compile_compiles_has_no_graph_break(config):
    """A graph break splits a compiled forward in two, runs the code between eagerly and makes a fullgraph
    compile fail; torch 2.11 (the GPU image's) broke every Decoder's forward at `Run(a, ctx)` (a dataclass
    default that was a StepContext), which torch 2.13 traces. Training (forward and backward) and evaluation."""
    from pretrain.models.base import EVAL

    name, *over = config.split()
    model, batch = model_and_batch(name, [f"model.{o}" for o in over])
    model.compile(backend="eager")
    before = dict(torch._dynamo.utils.counters["graph_break"])  # the counters outlive dynamo.reset
    loss_and_grads(model, batch)
    with torch.no_grad():
        model.eval()(batch, EVAL)
    breaks = {why: n - before.get(why, 0) for why, n in torch._dynamo.utils.counters["graph_break"].items()}
    assert not any(breaks.values()), breaks

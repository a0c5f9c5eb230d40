"""A resumed run keeps its measured kernel choices (kernels/registry.py: saved_choices, restore_choices):
saved as JSON in a checkpoint's meta, put back before the first step, the keys not measured again; made
on another device model or release, or unreadable, they are measured again with one line saying so. On
the CPU with the fake paths and clock of test_kernel_measure, and through the trainer with an extra
attention path measured on the CPU."""
import json

import pytest
import torch

from kernels import registry
from test_kernel_measure import MS, Clock, make_op


@pytest.fixture(autouse=True)
def clean():
    was = registry.measuring()
    registry.measuring(True)
    registry.reset_choices()
    yield
    registry._OPS.pop("test_measured", None)
    registry._used.pop("test_measured", None)
    registry.reset_choices()
    registry.measuring(was)


def _saved() -> dict:
    return json.loads(json.dumps(registry.saved_choices()))  # what a checkpoint's meta.json holds


def test_a_restored_choice_is_run_unmeasured_and_said():
    clock = Clock()
    op = make_op(clock, {"a": lambda n: 9 * MS, "b": lambda n: 2 * MS, "c": lambda n: 5 * MS})
    op(torch.ones(8))
    assert len(clock.timed) == 3
    saved = _saved()
    assert saved["context"] == registry.context() and saved["choices"][0]["path"] == "b"
    registry.reset_choices()  # a new process

    line = registry.restore_choices(saved)
    assert line == ("kernels: 1 measured choice kept from the checkpoint (test_measured b): the resumed run runs "
                    "the paths it ran, unmeasured")
    assert op(torch.ones(8)).tolist() == [3.0] * 8  # b, without a measurement
    assert len(clock.timed) == 3
    (choice,) = registry.choices()["test_measured"]
    assert str(choice) == "test_measured [n=8]: b (2.00 ms fwd+bwd) over c (5.00 ms), a (9.00 ms); kept from the checkpoint"
    op(torch.ones(16))  # a key the run had not met is measured as usual
    assert len(clock.timed) == 6


def test_choices_from_another_device_or_release_are_measured_again():
    clock = Clock()
    op = make_op(clock, {"a": lambda n: 9 * MS, "b": lambda n: 2 * MS, "c": lambda n: 5 * MS})
    op(torch.ones(8))
    saved = _saved()
    saved["context"]["device"] = "NVIDIA H100 80GB HBM3"
    registry.reset_choices()
    line = registry.restore_choices(saved)
    assert line.startswith("kernels: the measured choices in the checkpoint were made on NVIDIA H100 80GB HBM3 (torch ")
    assert line.endswith("; measuring again") and not registry.choices()
    op(torch.ones(8))
    assert len(clock.timed) == 6


@pytest.mark.parametrize("saved, why", [
    ("junk", "TypeError"),
    ({"context": {}, "choices": [{"op": "test_measured"}]}, "KeyError: 'key'"),
    ({"context": {}, "choices": [{"op": "x", "key": [1], "names": ["a"], "path": "z", "where": "", "seconds": {}}]},
     "ValueError: the path 'z' is not among ('a',)"),
    ({"context": {}, "choices": [{"op": "x", "key": {"dtype": "Tensor"}, "names": ["a"], "path": "a", "where": "",
                                  "seconds": {}}]}, "ValueError: unknown tagged value"),
])
def test_an_unreadable_record_is_said_and_measured_again(saved, why):
    line = registry.restore_choices(saved)
    assert line.startswith(f"kernels: the measured choices in the checkpoint are unreadable ({why}")
    assert line.endswith("; measuring again") and not registry.choices()
    assert registry.restore_choices(None) is None and registry.restore_choices({}) is None


def test_keys_round_trip_through_json_and_others_are_not_saved():
    from kernels.attention import masks, measured

    q = k = v = torch.randn(2, 2, 64, 8, dtype=torch.bfloat16)
    key = measured.shape_key(q, k, v, masks.decoder_mask(torch.zeros(2, 64, dtype=torch.long), 16))
    assert any(isinstance(x, torch.dtype) for x in key) and isinstance(key[0], tuple)
    assert registry._from_plain(json.loads(json.dumps(registry._to_plain(key)))) == key

    clock = Clock()
    op = make_op(clock, {"a": lambda n: 9 * MS, "b": lambda n: 2 * MS, "c": lambda n: 5 * MS})
    op.measure_with(registry.Measured(key=lambda x: ("len", x.shape[0], object()), timer=clock.timer,
                                      inputs=lambda key: ((torch.randn(key[1], requires_grad=True),), {})))
    op(torch.ones(8))
    assert registry.choices()["test_measured"] and registry.saved_choices() is None  # its key cannot be written


def test_a_resumed_training_run_keeps_its_attention_choice(tmp_path, monkeypatch):
    """Attention measured on the CPU (the key without its CUDA check, a second automatic path, a fake
    timer): the first run measures and its checkpoint holds the choice; the resumed run says it kept it,
    measures no training key again, and its kernels line names the kept choice."""
    import kernels.attention as attn
    from kernels.attention import measured, reference
    from pretrain.config import load_config
    from pretrain.trainer import Trainer
    from trainer_helpers import tiny_overrides, write_markov_corpus

    timed = []

    def timer(run):  # no path is run: the second candidate (reference) wins every key
        timed.append(run)
        return 2 * MS if len(timed) % 2 == 0 else 3 * MS

    op = attn.OP
    monkeypatch.setattr(op, "paths", dict(op.paths))
    monkeypatch.setattr(op, "_automatic", list(op._automatic))
    monkeypatch.setattr(op, "measured", op.measured)
    op.register("reference_auto", reference.attention, priority=1)
    op.measured = registry.Measured(measured.shape_key, measured.inputs, timer=timer, describe=measured.describe)

    corpus = write_markov_corpus(tmp_path / "markov", num_docs=40)

    def run(steps):
        lines = []
        over = tiny_overrides(tmp_path, corpus, **{"train.max_steps": steps, "checkpoint.every": 2, "train.eval_every": 0,
                                                   "train.compile": "false", "schedule.warmup_steps": 0})
        Trainer(load_config("baseline/tiny", over), log=lines.append).fit()
        return lines

    first = run(2)
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000002" / "meta.json").read_text())
    saved = [c for c in meta["kernel_choices"]["choices"] if c["key"][8]]  # the training keys (grad)
    assert saved and {c["path"] for c in saved} == {"reference_auto"}, meta["kernel_choices"]
    assert any("attention reference_auto" in line for line in first if line.startswith("kernels:"))

    registry.reset_choices()  # a new process
    timed.clear()
    second = run(4)
    kept = [line for line in second if "kept from the checkpoint" in line and line.startswith("kernels: ")]
    assert kept and kept[0].startswith(f"kernels: {len(meta['kernel_choices']['choices'])} measured choice"), second
    train_keys = [c for c in registry.choices()["attention"] if c.key[8]]
    assert train_keys and all(c.kept == "the checkpoint" for c in train_keys)
    fresh = [c for c in registry.choices()["attention"] if not c.kept]  # the end-of-run evaluation's, if new
    assert len(timed) == 2 * len(fresh)


def test_each_rank_restores_rank_0s_choices_for_its_own_device():
    # rank 0 saved keys naming cuda:0; rank 3's calls name cuda:3 (torch.device objects need no GPU)
    import kernels.attention  # noqa: F401  (the op exists, measured: what the trainer's built model ensures)

    record = {"op": "attention", "key": [["Causal"], 4, 2, 2, 64, 64, 8, {"dtype": "bfloat16"}, True, "cuda:0"],
              "names": ["triton", "sdpa"], "path": "triton", "where": "w", "seconds": {"triton": 1e-3, "sdpa": 2e-3}}
    line = registry.restore_choices({"context": registry.context(), "choices": [record]},
                                    device=torch.device("cuda", 3))
    assert line.startswith("kernels: 1 measured choice kept from the checkpoint (attention triton)")
    (key, names), = registry._choices["attention"]
    assert key == (("Causal",), 4, 2, 2, 64, 64, 8, torch.bfloat16, True, "cuda:3") and names == ("triton", "sdpa")
    registry.reset_choices()
    registry.restore_choices({"context": registry.context(), "choices": [record]}, device=torch.device("cpu"))
    assert next(iter(registry._choices["attention"]))[0][-1] == "cuda:0"  # not a CUDA rank: kept as saved


def test_a_forced_op_or_measuring_off_keeps_nothing():
    clock = Clock()
    op = make_op(clock, {"a": lambda n: 9 * MS, "b": lambda n: 2 * MS, "c": lambda n: 5 * MS})
    op(torch.ones(8))
    saved = _saved()
    registry.reset_choices()
    op.force("c")  # PRETRAIN_KERNELS names the path: the kept choice would not be run, so it is not said
    assert registry.restore_choices(saved) is None and not registry.choices()
    op.force(None)
    registry.measuring(False)
    assert registry.restore_choices(saved) == ("kernels: measuring is off (PRETRAIN_KERNELS_MEASURE=0): the measured "
                                               "choices in the checkpoint are not used")
    assert not registry.choices()
    registry.measuring(True)
    registry._OPS.pop("test_measured")  # an op not created yet (its module not imported): measure_with would forget
    assert registry.restore_choices(saved) is None and not registry.choices()

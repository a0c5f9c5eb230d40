"""lm-evaluation-harness on every architecture's Hugging Face folder, offline, on two local tasks.

`lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True` runs a multiple-choice
loglikelihood task and a generate_until task (task YAMLs with `dataset_path: json` over files written
here, `HF_DATASETS_OFFLINE=1`); every logged loglikelihood equals the one computed from `spec.logits` of
the run the folder was exported from, and every generation our greedy decode. `pretrain eval --lm-eval`
wraps the harness for a run, a checkpoint and a folder, stores the table where its docstring says, and
refuses what it cannot do in one sentence.
"""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from pretrain.cli import main
from pretrain.export.writer import export
from pretrain.generate import generate, load_for_inference
from pretrain.models import all_archs
from test_export import quiet, train
from trainer_helpers import write_markov_corpus

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (the [lm-eval] extra)")
pytest.importorskip("accelerate", reason="lm-evaluation-harness's hf model needs accelerate (the [lm-eval] extra)")
transformers = pytest.importorskip("transformers", reason="the harness loads Hugging Face folders")
# CI runs the Llama folder and one remote-code folder; the other four are `slow` (about 20 s each)
ARCHS = [a if a in ("baseline", "gpn") else pytest.param(a, marks=pytest.mark.slow)
         for a in (s.name for s in all_archs() if s.hf.model_type)]
MC = [{"question": "t5 t9 t12", "choices": ["t7", "t8 t9", "t30"], "answer": 1},
      {"question": "t1 t2 t3 t4", "choices": ["t3", "t4 t5 t6"], "answer": 0}]
GEN = [{"prompt": "t5 t9 t12", "target": "t7"}, {"prompt": "t1 t2", "target": "t3"}]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_markov_corpus(tmp_path_factory.mktemp("corpus") / "markov")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    for name, rows in (("mc", MC), ("gen", GEN)):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    (root / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (root / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return str(root)


OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def encode_pair(tok, context: str, continuation: str) -> tuple[list, list]:
    """The harness's HFLM._encode_pair: trailing spaces of the context move to the continuation, and the
    continuation's tokens are those of the whole string after the context's."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_harness_scores_every_architecture_as_its_logits_do(arch, tmp_path, corpus, tasks):
    run = train(tmp_path, corpus, arch)
    folder = str(tmp_path / "hf")
    export(run, folder, fmt="hf", log=quiet)
    out = tmp_path / "lm_eval"
    cmd = [os.path.join(os.path.dirname(sys.executable), "lm_eval"), "--model", "hf", "--model_args",
           f"pretrained={folder},trust_remote_code=True", "--tasks", "tiny_mc,tiny_gen", "--include_path", tasks,
           "--log_samples", "--output_path", str(out), "--batch_size", "1", "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **OFFLINE}, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]

    model, spec, _, _ = load_for_inference(run, log=quiet)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    mc = [json.loads(line) for p in glob.glob(str(out / "*" / "samples_tiny_mc_*.jsonl")) for line in open(p)]
    assert len(mc) == len(MC)
    checked = 0
    for sample in mc:
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            ctx, cont = encode_pair(tok, args["arg_0"], args["arg_1"])
            tokens = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = torch.log_softmax(spec.logits(model, tokens[:, :-1]).double(), -1)[0]
            ours = sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))
            assert abs(float(resp[0][0]) - ours) <= 1e-4, (args, resp, ours)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in MC)

    gen = [json.loads(line) for p in glob.glob(str(out / "*" / "samples_tiny_gen_*.jsonl")) for line in open(p)]
    assert len(gen) == len(GEN)
    for sample in gen:
        ctx = tok.encode(sample["arguments"]["gen_args_0"]["arg_0"], add_special_tokens=False)
        ours = generate(model, spec, [ctx], 6, temperature=0)[0]
        text = tok.decode(ours, skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0].strip() == text.strip(), (sample["resps"], text)


def test_pretrain_eval_wraps_the_harness_for_runs_checkpoints_and_folders(tmp_path, corpus, tasks, capsys,
                                                                          monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    run = train(tmp_path, corpus, "gpn")
    ckpt = os.path.join(run, "checkpoints", "step_00000004")
    folder = str(tmp_path / "folder")
    export(run, folder, log=quiet)  # a native folder: imported and exported again for the harness
    stored = {run: os.path.join(run, "lm_eval", "step_00000004-tiny_mc.json"),
              ckpt: os.path.join(run, "lm_eval", "step_00000004-tiny_mc.json"),
              folder: folder + ".lm_eval-tiny_mc.json"}
    accuracy = set()
    for source, where in stored.items():
        if os.path.exists(where):
            os.remove(where)
        assert main(["eval", source, "--lm-eval", "tiny_mc", "--lm-eval-include", tasks]) == 0
        printed = capsys.readouterr().out
        assert "tiny_mc" in printed and f"stored in {where}" in printed
        record = json.load(open(where))
        accuracy.add(record["results"]["tiny_mc"]["acc,none"])
    assert len(accuracy) == 1  # the same weights, whichever way they were given
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".lm_eval-")]  # temporary folders removed
    for argv, message in ((["--lm-eval", "no_such_task", "--lm-eval-include", tasks], "'no_such_task' does not exist"),
                          (["--lm-eval", "tiny_mc", "--batches", "2"], "does not combine with --batches"),
                          (["--lm-eval", "tiny_mc", "--sweep", "model.n_layers=1"], "does not combine with --sweep")):
        assert main(["eval", run, *argv]) == 2
        assert message in capsys.readouterr().err

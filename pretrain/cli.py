"""`pretrain`: train, evaluate, sample, plot, size, export and import models; index, compare and reproduce
experiments (pretrain/cli_experiments.py). Run `pretrain VERB --help`.

torch is imported inside the verbs, so `pretrain --help` answers at once.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import signal
import sys
import traceback

from data_tools.storage import EXIT_STORAGE, StorageError

from pretrain.cli_help import (_EXPORT_HELP, _IMPORT_HELP, _INFERENCE_OVERRIDES, _INFO_HELP, _PLAN_HELP, _RUN_PATHS,
                               _TRAIN_HELP)
from pretrain.preemption import EXIT_REQUEUE, StopRequested


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (the usage is one --help away), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    top = _Parser(prog="pretrain", description="Pretrain recurrent transformer architectures.",
                                  epilog="Run `pretrain VERB --help` for the options and examples of each verb.")
    verbs = top.add_subparsers(dest="verb", metavar="VERB", required=True)
    # the order verbs are added is the order `pretrain --help` lists them
    _add_training_verbs(verbs)
    _add_folder_verbs(verbs)
    _add_tool_verbs(verbs)
    from pretrain.cli_experiments import add_verbs

    add_verbs(verbs, _verb)
    return top


def _verb(verbs, name, help_, epilog=None):
    """One verb's parser: its help doubles as its description; epilogs keep their line breaks."""
    return verbs.add_parser(name, help=help_, description=help_, epilog=epilog,
                            formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_training_verbs(verbs) -> None:
    """train, eval and generate: the verbs that run a model."""
    t = _verb(verbs, "train", "train a model from a config (resumes a run directory's latest checkpoint)",
              _TRAIN_HELP)
    t.add_argument("config", help="a YAML file, a shipped config's short name (e.g. baseline/tiny) or a run "
                   "directory to resume")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4")

    e = _verb(verbs, "eval",
              "validation loss and perplexity of a checkpoint (and a synthetic task's accuracy per level)",
              "examples:\n  pretrain eval runs/quickstart --batches 50 --unigram-entropy\n"
              "  pretrain eval runs/quickstart data.valid=[data/other_text_document]\n"
              "  pretrain eval runs/pc-tiny          # data.task runs: also 'accuracy L0 ... LH' on held-out sequences\n\n"
              + _RUN_PATHS)
    e.add_argument("path", help="a run directory (its latest checkpoint), a checkpoint directory or an exported folder")
    e.add_argument("overrides", nargs="*", help=_INFERENCE_OVERRIDES)
    e.add_argument("--batches", type=int, default=0, help="micro batches to evaluate, >= 1 (default: "
                   "train.eval_batches; fewer when the validation data is shorter)")
    e.add_argument("--unigram-entropy", action="store_true",
                   help="also print the unigram entropy of the validation tokens: a model that learned "
                   "context scores well below it")
    e.add_argument("--sweep", metavar="FIELD=V1,V2,...",
                   help="evaluate the same weights at each value of one inference field and print a table, e.g. "
                   "--sweep model.n_loops=2,4,6,8,10,12,14,16 (CART's R') or --sweep model.eval_k=1,2,4,8 (CRT); "
                   "every value is checked before the first evaluation")
    e.add_argument("--json", action="store_true", help="print one JSON object (a list of them with --sweep)")
    e.add_argument("--lm-eval", metavar="TASKS", help="run lm-evaluation-harness tasks (comma-separated, e.g. "
                   "hellaswag,lambada_openai) on the model instead, at batch size 1, through its Hugging Face folder "
                   "(a run or checkpoint is exported to a temporary one); prints the table and stores it beside PATH "
                   "(RUN/lm_eval/step_N-TASKS.json, or FOLDER.lm_eval-TASKS.json); needs the [lm-eval] extra")
    e.add_argument("--lm-eval-include", metavar="DIR", default="",
                   help="a directory of task YAML files of your own for --lm-eval (the harness's --include_path)")
    e.add_argument("--lm-eval-limit", metavar="N", type=float, default=None,
                   help="N > 0: at most N documents per task (a fraction of them when below 1): a quick check, not a score")

    g = _verb(verbs, "generate", "sample text from a checkpoint with a KV cache",
              "example:\n  pretrain generate runs/quickstart --prompt 'The list type' --max-tokens 60 --top-k 40\n\n"
              + _RUN_PATHS)
    g.add_argument("path", help="a run directory (its latest checkpoint), a checkpoint directory or an exported folder")
    g.add_argument("overrides", nargs="*", help=_INFERENCE_OVERRIDES)
    g.add_argument("--prompt", default="", help="text to continue (default: the beginning of a document)")
    g.add_argument("--max-tokens", type=int, default=100, help="tokens to generate at most, >= 1 (default 100; "
                   "fewer when the end-of-document token comes first)")
    g.add_argument("--temperature", type=float, default=None, help=">= 0; 0 = greedy (default 0.8, or an exported "
                   "folder's generation_config.json)")
    g.add_argument("--top-k", type=int, default=None, help=">= 0: keep the k most likely tokens (default 0 = all)")
    g.add_argument("--top-p", type=float, default=None, help="in (0, 1]: nucleus sampling mass (default 1 = off)")
    g.add_argument("--seed", type=int, default=0, help="the sampling seed: the same seed, prompt and model give "
                   "the same text (default 0)")
    g.add_argument("--num-samples", type=int, default=1, help=">= 1: continuations of the same prompt, each "
                   "printed after a '--- sample K' line when more than one (default 1)")


def _add_folder_verbs(verbs) -> None:
    """export and import: a checkpoint to a self-contained folder and back."""
    x = _verb(verbs, "export", "write a checkpoint as a self-contained folder (safetensors, config, tokenizer, "
              "model card), natively or for Hugging Face transformers", _EXPORT_HELP)
    x.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run directory (its latest checkpoint) or a "
                   "checkpoint directory")
    x.add_argument("out", metavar="OUT", help="the folder to write")
    x.add_argument("--format", choices=("native", "hf"), default="native",
                   help="native (default) or hf: a folder transformers loads (the baseline as LlamaForCausalLM; "
                   "the others with their own generated code, trust_remote_code=True); every architecture")
    x.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="",
                   help="weights' dtype in the folder (default: the checkpoint's)")
    x.add_argument("--tokenizer", default="", help="the tokenizer to ship (default: the run's)")
    x.add_argument("--force", action="store_true", help="replace OUT if it exists")

    m = _verb(verbs, "import", "turn a Hugging Face folder (Llama, or one of ours), an exported folder or a run into a run "
              "directory to fine-tune (optionally converted into another architecture)", _IMPORT_HELP)
    m.add_argument("source", metavar="SOURCE", help="an HF folder, an exported folder, or a run/checkpoint directory")
    m.add_argument("out", metavar="OUT_RUN", help="the run directory to write")
    m.add_argument("overrides", nargs="*", help="dotted overrides of OUT_RUN's config, e.g. model.k_max=5")
    m.add_argument("--arch", default="", help="convert into this architecture (default: the source's)")
    m.add_argument("--tokenizer", default="", help="the tokenizer file (default: the source's)")
    m.add_argument("--force", action="store_true", help="replace OUT_RUN if it exists")


def _add_tool_verbs(verbs) -> None:
    """plot, plan and info: loss curves, parallel layouts and sizes, without training."""
    p = _verb(verbs, "plot", "plot the loss curves of one or more runs to a PNG",
              "example:\n  pretrain plot runs/a runs/b --output loss.png")
    p.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    p.add_argument("--output", default="loss.png", help="the image to write: .png, .pdf or .svg, in an existing "
                   "folder (default loss.png)")
    p.add_argument("--x", choices=("step", "tokens"), default="step",
                   help="the x axis: optimizer steps or tokens seen (default step)")

    pl = _verb(verbs, "plan", "check a large parallel layout without its GPUs: build every pipeline stage on "
               "the meta device and report what each rank holds", _PLAN_HELP)
    pl.add_argument("config", help="a YAML file, a shipped config's short name (e.g. sps/l) or a run directory")
    pl.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.micro_batch_seqs=2")
    pl.add_argument("--dry-run", action="store_true", help="build and shape-check the layout given by --layout on "
                    "torch's fake process group (no GPU, no memory)")
    pl.add_argument("--layout", default="", metavar="tp=T,pp=P,dp=D", help="the layout to dry-run, each size >= 1 "
                    "(sizes left out are 1; no --layout: one rank), e.g. tp=4,pp=2,dp=8 for 64 GPUs")
    pl.add_argument("--json", action="store_true", help="print one JSON object per stage, a line each (--dry-run)")
    pl.add_argument("--gpus", type=int, default=0, help="plan for this many GPUs (>= 1): every layout the config "
                    "allows, its memory per GPU and predicted step time, and the fastest that fits")
    pl.add_argument("--gpu", choices=("a100", "h100", "h200"), default="h100", help="the GPU (default h100)")
    pl.add_argument("--gpu-memory", type=float, default=0.0, metavar="GIB",
                    help="memory per GPU in GiB, > 0 (default: the GPU's: 80, 80, 141)")

    i = _verb(verbs, "info", "parameter counts and FLOPs per token of a config, without allocating it",
              _INFO_HELP)
    i.add_argument("config", nargs="?", default="", help="a YAML file, a shipped config's short name (e.g. "
                   "gpn/tiny) or a run directory")
    i.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.n_layers=8")
    i.add_argument("--json", action="store_true", help="print params_total, params_embedding, "
                   "params_non_embedding and flops_per_token as JSON")
    i.add_argument("--list", action="store_true", help="list the shipped configs by short name, one per line")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options (`import SRC OUT --arch crt model.k_max=5`); argparse leaves them over.
    if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # megatron-core says on import, four times per rank, that it falls back to torch's optimizers and
    # kernels without Transformer Engine or apex: the expected path here, not news to a user
    import warnings

    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    if argv is None and args.verb in ("train", "eval", "generate"):  # run as the program: before torch loads
        from pretrain.malloc import use_caching_allocator

        use_caching_allocator()
    if argv is None and args.verb == "train":  # the program: leave without tearing down the process group
        from parallel.dist import exit_process

        # `kill -USR2 PID` prints every thread's Python stack and training goes on: where a hang or a long
        # compile is (the GPU suite sends it to a run it stops at its cap); SIGUSR1 is a stop signal
        faulthandler.register(signal.SIGUSR2, all_threads=True)

        try:
            code = _run(args)
        except BaseException as e:  # noqa: BLE001  (printed as the interpreter would, then the same exit)
            code = e.code if isinstance(e, SystemExit) else 1
            if not isinstance(e, SystemExit):
                traceback.print_exc()
        exit_process(code)
    return _run(args)


def _run(args) -> int:
    """The verb's handler, its expected failures turned into one line and an exit code."""
    from pretrain.cli_experiments import HANDLERS

    handlers = {"train": _train, "eval": _eval, "generate": _generate, "plot": _plot, "info": _info,
                "export": _export, "import": _import, "plan": _plan, **HANDLERS}
    try:
        return handlers[args.verb](args)
    except StopRequested as e:  # Ctrl-C: 130 as for any interrupted program; a scheduler's signal: requeue
        interrupted = e.signame == "SIGINT"
        print(f"pretrain {args.verb}: {'interrupted: ' if interrupted else ''}{e}", file=sys.stderr)
        return 130 if interrupted else EXIT_REQUEUE
    except KeyboardInterrupt:
        print(f"pretrain {args.verb}: interrupted", file=sys.stderr)
        return 130
    except StorageError as e:  # one sentence; nothing written before is lost (writes go to temporaries renamed into place)
        print(f"pretrain {args.verb}: error: {e}; nothing written before was lost: run the same command again "
              "once the storage is fixed" + (" (it resumes from the latest checkpoint)" if args.verb == "train" else ""),
              file=sys.stderr)
        return EXIT_STORAGE
    except Exception as e:
        if not isinstance(e, (ValueError, FileNotFoundError)) and type(e).__name__ not in _CLEAN_ERRORS:
            raise  # an unexpected failure keeps its traceback
        print(f"pretrain {args.verb}: error: {e}", file=sys.stderr)
        return 2


_CLEAN_ERRORS = {"CheckpointError", "CorruptCheckpoint", "NonFiniteLossError", "BadStepsError", "IndexedFormatError", "ConfigError",
                 "ProfileError"}


def _info(args) -> int:
    from pretrain.config import load_config, shipped_configs
    from pretrain.models import count_parameters, get_arch, meta_model

    if args.list:
        print("\n".join(shipped_configs()))
        return 0
    if not args.config:
        raise ValueError("pretrain info needs a CONFIG (a YAML file, a shipped config's short name or a run "
                         "directory), or --list for the shipped configs")

    cfg = load_config(args.config, args.overrides, check_data=False)
    spec = get_arch(cfg.model.arch)
    counts = count_parameters(meta_model(cfg.model))
    flops = spec.flops_per_token(cfg.model, cfg.data.seq_len, None)
    out = {"params_total": counts["total"], "params_embedding": counts["embedding"],
           "params_non_embedding": counts["non_embedding"], "flops_per_token": flops,
           "flops_formula": spec.flops_formula}
    formula = spec.formula_params(cfg.model)
    if formula is not None:
        out["params_paper_formula"] = formula
    if lines := spec.info(cfg.model):
        out["info"] = lines
    if args.json:
        print(json.dumps(out))
    else:
        by_formula = (f"; {formula:,} by the paper's formula ({counts['total'] / formula - 1:+.2%} here: it leaves "
                      "out biases and norms)") if formula is not None else ""
        print(f"{cfg.model.arch}: {counts['total']:,} parameters ({counts['embedding']:,} embedding, "
              f"{counts['non_embedding']:,} non-embedding){by_formula}; {flops / 1e9:,.3f} GFLOP per training "
              f"token at T={cfg.data.seq_len}; {flops * cfg.tokens_per_step / 1e12:,.1f} TFLOP per step")
        if cfg.model.paper_params:
            print(f"the paper gives {cfg.model.paper_params:,} for this configuration")
        for line in spec.info(cfg.model):
            print(line)
        policies = spec.recompute_policies()
        if policies:  # a policy that configures the model's own recomputation says so
            named = [n + (" (the model's own)" if p.kind == "configure" else "") for n, p in policies.items()]
            print(f"activation recompute (parallel.recompute): none, {', '.join(named)}")
        print(f"FLOPs per token = {spec.flops_formula}")
    return 0


def _plan(args) -> int:
    if args.dry_run == bool(args.gpus):
        raise ValueError("pretrain plan needs either --gpus N (the planner) or --dry-run --layout tp=T,pp=P,dp=D")
    if args.gpus < 0 or args.gpu_memory < 0:
        raise ValueError(f"--gpus and --gpu-memory must be positive, got {args.gpus} and {args.gpu_memory:g}")
    from pretrain.config import load_config
    from pretrain.plan import parse_layout, plan_lines, run_dry

    if args.dry_run:
        parse_layout(args.layout)  # checked before the config is read
    cfg = load_config(args.config, args.overrides, check_data=False)
    if args.dry_run:
        print("\n".join(run_dry(cfg, args.layout, as_json=args.json)))
    else:
        print("\n".join(plan_lines(cfg, args.gpus, args.gpu, args.gpu_memory or None)))
    return 0


def _train(args) -> int:
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    from pretrain import stack_samples

    # a first step that takes minutes (a compile) says where it is, sampled (PRETRAIN_STACKS_EVERY); the trainer
    # stops the samples once its first step is logged
    if every := stack_samples.every():
        stack_samples.start(every)
    try:
        trainer = Trainer(load_config(args.config, args.overrides))  # refuses a forced kernel path before any work
        record = trainer.fit()
    finally:
        stack_samples.stop()
    if "val_loss" in record:
        trainer.log(f"final: step {record['step']}, train loss {record['loss']:.4f}, val loss {record['val_loss']:.4f} "
                    f"(ppl {record['val_ppl']:.1f})")
    return 0


def _sweep(args) -> int:
    """`pretrain eval --sweep FIELD=V1,V2,...`: the validation loss of the same weights at each value."""
    from pretrain.generate import load_for_inference

    field, _, values = args.sweep.partition("=")
    values = [v for v in values.split(",") if v]
    if not field or not values or field in {o.split("=", 1)[0] for o in args.overrides}:
        raise ValueError(f"--sweep {args.sweep!r}: give one field and its values, FIELD=V1,V2,... (a field the "
                         "overrides do not also set)")
    for v in values:  # every value is refused or accepted before the first evaluation
        load_for_inference(args.path, overrides=[*args.overrides, f"{field}={v}"], need=("tokenizer", "eval"),
                           log=lambda *_: None)
    rows = []
    for v in values:
        one = argparse.Namespace(**{**vars(args), "sweep": None, "json": True,
                                    "overrides": [*args.overrides, f"{field}={v}"]})
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            _eval(one)
        rows.append({field: v, **json.loads(buffer.getvalue())})
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{field:>20} {'val loss':>10} {'perplexity':>11}")
    for row in rows:
        print(f"{row[field]:>20} {row['val_loss']:>10.4f} {row['val_ppl']:>11.2f}")
    return 0


def _lm_eval(args) -> int:
    """`pretrain eval PATH --lm-eval TASKS` (pretrain/harness.py)."""
    from pretrain.harness import run_harness

    for flag, given in (("--sweep", args.sweep), ("--batches", args.batches), ("--unigram-entropy", args.unigram_entropy),
                        ("overrides", args.overrides)):
        if given:
            raise ValueError(f"--lm-eval runs the harness's own tasks; it does not combine with {flag}")
    if args.lm_eval_limit is not None and args.lm_eval_limit <= 0:
        raise ValueError(f"--lm-eval-limit must be positive, got {args.lm_eval_limit:g}")
    limit = int(args.lm_eval_limit) if args.lm_eval_limit and args.lm_eval_limit >= 1 else args.lm_eval_limit
    out = run_harness(args.path, [t.strip() for t in args.lm_eval.split(",")], args.lm_eval_include, limit,
                      log=(lambda *_: None) if args.json else print)
    if args.json:
        print(json.dumps({"results": out["results"], "stored": out["stored"]}, default=str))
    else:
        print(out["table"])
        print(f"stored in {out['stored']}")
    return 0


def _eval(args) -> int:
    from pretrain.data.build import valid_dataset
    from pretrain.generate import load_for_inference
    from pretrain.tasks import accuracy_line, evaluate_accuracy
    from pretrain.trainer import collator_for, evaluate_loss

    if args.batches < 0:
        raise ValueError(f"--batches must be at least 1 (or left out for train.eval_batches), got {args.batches}")
    if getattr(args, "lm_eval", None) is not None:
        return _lm_eval(args)
    if getattr(args, "sweep", None):
        return _sweep(args)
    model, spec, cfg, _ = load_for_inference(args.path, overrides=args.overrides, need=("tokenizer", "eval"))
    if args.unigram_entropy and cfg.data.task:
        raise ValueError(f"--unigram-entropy reads validation files; this run trains on data.task={cfg.data.task}")
    data, available = valid_dataset(cfg.data)
    micro = cfg.train.micro_batch_seqs
    n = min((args.batches or cfg.train.eval_batches) * micro, available)
    device = next(model.parameters()).device
    result = evaluate_loss(model, data, n, micro, collator_for(cfg.data), device,
                           progress=_progress("evaluating batches") if not args.json else None)
    if cfg.data.task:  # the task's accuracy per group, e.g. per pointer-chasing level (val_acc_L0 ...)
        result.update(evaluate_accuracy(model, spec.logits, data, n, micro, device))
    if args.unigram_entropy:
        result["unigram_entropy"] = unigram_entropy(cfg.data, cfg.model.vocab_size)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"val loss {result['val_loss']:.4f} nats/token, perplexity {result['val_ppl']:.2f} "
          f"({result['val_tokens']:,} tokens)")
    for line in spec.inference_settings(cfg.model, cfg.data.seq_len):
        print(line)
    diagnostics = {k[4:]: v for k, v in result.items() if k.startswith("val_") and k[4:] not in (
        "loss", "ppl", "tokens") and not k.startswith("val_acc")}
    if diagnostics:
        print("diagnostics: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(diagnostics.items())))
    if cfg.data.task:
        print(f"{cfg.data.task} {accuracy_line(result)} ({n:,} held-out sequences)")
    if args.unigram_entropy:
        gap = result["unigram_entropy"] - result["val_loss"]
        print(f"unigram entropy of the validation tokens {result['unigram_entropy']:.4f} nats; "
              f"the model is {gap:.3f} nats below it")
    return 0


def _progress(what: str):
    """A progress callback report(done, total) for long work: a line rewritten in place on a terminal's
    stderr, at most every half second; None when stderr is not a terminal (logs stay clean)."""
    import time

    if not sys.stderr.isatty():
        return None
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if total <= 1 or (done < total and now - last[0] < 0.5):
            return
        last[0] = now
        print(f"\r{what}: {done}/{total}", end="\n" if done >= total else "", file=sys.stderr, flush=True)

    return report


def unigram_entropy(data, vocab_size: int) -> float:
    """Entropy (nats) of the token frequencies of the validation documents: the loss of the best
    context-free model of those very tokens."""
    import numpy as np

    from pretrain.data.build import valid_parts

    counts = np.zeros(vocab_size, dtype=np.int64)
    for part in valid_parts(data):
        lo, hi = part.document_range
        starts, lengths = part.indexed.document_token_bounds()
        counts += np.bincount(part.indexed.tokens[starts[lo] : starts[hi - 1] + lengths[hi - 1]],
                              minlength=vocab_size)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _check_generate_args(args) -> None:
    """Every sampling argument in its range, one sentence each, before anything is loaded."""
    checks = [("--max-tokens", args.max_tokens, args.max_tokens >= 1, "at least 1"),
              ("--num-samples", args.num_samples, args.num_samples >= 1, "at least 1"),
              ("--temperature", args.temperature, args.temperature is None or args.temperature >= 0,
               ">= 0 (0 is greedy)"),
              ("--top-k", args.top_k, args.top_k is None or args.top_k >= 0, ">= 0 (0 keeps every token)"),
              ("--top-p", args.top_p, args.top_p is None or 0 < args.top_p <= 1, "in (0, 1] (1 turns it off)")]
    for name, value, ok, want in checks:
        if not ok:
            raise ValueError(f"{name} must be {want}, got {value}")


def continuation(tok, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text new_ids add after the prompt: decode(prompt + new) with decode(prompt) taken off its front,
    so a first piece that starts a word keeps its space (decoding new_ids alone drops it)."""
    head, whole = tok.decode(prompt_ids), tok.decode(prompt_ids + new_ids)
    return whole[len(head):] if whole.startswith(head) else tok.decode(new_ids)


def _generate(args) -> int:
    from pretrain.generate import generate, load_for_inference

    _check_generate_args(args)
    model, spec, cfg, tok = load_for_inference(args.path, overrides=args.overrides)
    if tok is None:
        raise ValueError(f"no tokenizer was saved with {args.path}; generation needs one (data.tokenizer)")
    from pretrain.export.loader import SAMPLING, sampling_defaults

    prompt = tok.encode(args.prompt) if args.prompt else []
    if not prompt:
        prompt = [tok.special_ids().get("bos") or tok.eod_id]
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    sampling = {**SAMPLING, **sampling_defaults(args.path), **{k: v for k, v in given.items() if v is not None}}
    from kernels import describe_paths_used, reset_paths_used

    reset_paths_used()
    outs = generate(model, spec, [prompt] * args.num_samples, args.max_tokens, sampling["temperature"],
                    int(sampling["top_k"]), sampling["top_p"], args.seed, eos_id=tok.eod_id, pad_id=tok.pad_id)
    print(f"kernels: {describe_paths_used()}", file=sys.stderr)  # which path served each op (stdout: the text)
    for k, ids in enumerate(outs):
        if args.num_samples > 1:
            print(f"--- sample {k}")
        print(args.prompt + continuation(tok, prompt, ids))
    return 0


def _export(args) -> int:
    from pretrain.export.writer import export

    import shlex

    command = "pretrain export " + shlex.join(sys.argv[2:]) if sys.argv[1:2] == ["export"] else ""
    r = export(args.source, args.out, args.format, args.dtype, args.force, args.tokenizer, command=command,
               progress=_progress("exporting tensors"))
    print(f"exported {r['arch']} step {r['step']} ({r['params']:,} parameters, {r['dtype']}, "
          f"{r['bytes'] / 2**20:,.1f} MiB) from {r['checkpoint']} to {r['out']} ({r['format']} format) in "
          f"{r['seconds']:.1f} s")
    return 0


def _import(args) -> int:
    from pretrain.export.importer import finetune_command, import_run

    r = import_run(args.source, args.out, args.arch, args.overrides, args.force, args.tokenizer)
    print(f"imported {r['source']} into {r['out']}: model.arch {r['arch']!r}, {r['params']:,} parameters"
          f"{r['converted']}{'' if r['tokenizer'] else ' (no tokenizer found: import with --tokenizer PATH, or give generate data.tokenizer=PATH)'}")
    print(f"fine-tune it in a new run: {finetune_command(r['out'])}")
    return 0


def _plot(args) -> int:
    import os

    from pretrain.experiments.compare import check_output, pyplot
    from pretrain.metrics import read_metrics

    check_output(args.output)
    runs = {}
    for run in args.runs:  # every run read before anything is drawn
        path = run if run.endswith(".jsonl") else os.path.join(run, "metrics.jsonl")
        if not os.path.isfile(path):
            raise ValueError(f"{run} is neither a run directory with a metrics.jsonl nor a metrics.jsonl file")
        runs[run] = read_metrics(run)
        if not any("loss" in r for r in runs[run]):
            raise ValueError(f"{run} has no training step logged yet")
    plt = pyplot("pretrain plot")
    fig, ax = plt.subplots(figsize=(8, 5))
    for run, records in runs.items():
        label = os.path.basename(os.path.normpath(run))
        train = [r for r in records if "loss" in r]
        ax.plot([r[args.x] for r in train], [r["loss"] for r in train], label=f"{label} train")
        val = [r for r in records if "val_loss" in r]
        if val:
            ax.plot([r[args.x] for r in val], [r["val_loss"] for r in val], "o--", label=f"{label} valid")
    ax.set_xlabel(args.x)
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(args.output, dpi=120, bbox_inches="tight")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

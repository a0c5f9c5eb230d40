"""`pretrain-data`: tokenizers, preprocessing to megatron's .bin/.idx, inspection and merging.

Heavy modules (numpy, sentencepiece, pyarrow) are imported inside the verb that needs them, and
torch and `datasets` never, so `pretrain-data --help` answers at once.
"""
from __future__ import annotations

import argparse
import os
import sys

_EXAMPLES = {
    "corpus": """example:
  pretrain-data corpus --output data/corpus
  # writes data/corpus/train.jsonl and valid.jsonl from the Python standard library's own docs""",
    "train-tokenizer": """examples:
  pretrain-data train-tokenizer --input data/corpus/train.jsonl --vocab-size 4096 \\
      --output-prefix data/tok/spm
  pretrain-data train-tokenizer --input 'shards/*.parquet' --json-key content \\
      --model-type unigram --vocab-size 32000 --output-prefix tok/unigram32k

The model reserves unk=0, bos=1, eos=2 (the end-of-document token), pad=3 and <predict>=4.""",
    "preprocess": """examples:
  # every .jsonl file of a directory, the "text" field, two worker processes
  pretrain-data preprocess --input data/jsonl/ --output-prefix data/mycorpus \\
      --tokenizer-model data/tok/spm.model --workers 2
  # -> data/mycorpus_text_document.bin and .idx (megatron's naming and format)

  pretrain-data preprocess --input 'raw/*.parquet' --json-keys title text ...
  pretrain-data preprocess --input docs/ --input-format text --text-unit file ...

Malformed JSON lines, records without the key, invalid UTF-8 and empty documents are skipped and
counted (--strict stops at the first one instead). An interrupted run keeps its finished partitions:
run the same command again to resume. Outputs appear only when the whole run succeeded.""",
    "inspect": """examples:
  pretrain-data inspect data/mycorpus_text_document
  pretrain-data inspect data/mycorpus_text_document --tokenizer-model data/tok/spm.model --decode 0 5""",
    "merge": """example:
  pretrain-data merge --inputs data/a_text_document data/b_text_document --output-prefix data/ab_text_document
  pretrain-data merge --inputs data/shards/ --output-prefix data/all_text_document   # every .idx in the folder""",
}


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="pretrain-data",
        description="Offline data tools: train a tokenizer, tokenize a corpus into megatron's indexed "
        "format (.bin/.idx), inspect and merge datasets.",
        epilog="Run `pretrain-data VERB --help` for the options and examples of each verb.",
    )
    verbs = top.add_subparsers(dest="verb", metavar="VERB", required=True)

    def verb(name, help_):
        return verbs.add_parser(name, help=help_, description=help_, epilog=_EXAMPLES[name],
                                formatter_class=argparse.RawDescriptionHelpFormatter)

    c = verb("corpus", "write the embedded corpus (the standard library's documentation) as jsonl")
    c.add_argument("--output", required=True, help="directory to write train.jsonl and valid.jsonl into")

    t = verb("train-tokenizer", "train a sentencepiece BPE or unigram tokenizer")
    _input_args(t)
    t.add_argument("--json-key", default="text", help="field holding the text (jsonl, parquet, datasets)")
    t.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    t.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, special tokens included")
    t.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    t.add_argument("--character-coverage", type=float, default=0.9995,
                   help="share of characters covered by the vocabulary; the rest fall back to bytes")
    t.add_argument("--max-sentences", type=int, default=2_000_000,
                   help="sample at most this many text pieces to train on (bounds memory)")
    t.add_argument("--threads", type=int, default=os.cpu_count() or 1)

    p = verb("preprocess", "tokenize jsonl / text / parquet / datasets folders into .bin/.idx")
    _input_args(p)
    p.add_argument("--output-prefix", required=True, help="writes {PREFIX}_{key}_document.bin/.idx")
    p.add_argument("--tokenizer-model", required=True,
                   help="sentencepiece .model, Hugging Face tokenizer.json, or a folder holding one")
    p.add_argument("--eos-token", help="the end-of-document token of a Hugging Face tokenizer whose eos "
                   "is not one of the usual names (</s>, <|endoftext|>, <eos>, <|end_of_text|>)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize, one output each")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="tokenizing processes")
    eod = p.add_mutually_exclusive_group()
    eod.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                     help="append the end-of-document token to every document (default)")
    eod.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    p.add_argument("--dtype", choices=("auto", "uint16", "int32"), default="auto",
                   help="token dtype; auto: uint16 below 65,500 vocabulary entries, else int32")
    p.add_argument("--chunk-mb", type=float, default=4.0, help="input read per work item")
    p.add_argument("--partition-mb", type=float, default=1024.0,
                   help="input per partition: the unit that is kept when a run is interrupted")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record instead of skipping it")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--stats-json", help=argparse.SUPPRESS)

    i = verb("inspect", "counts, length histogram, and decoded documents of a .bin/.idx dataset")
    i.add_argument("prefix", help="dataset prefix (PREFIX.bin / PREFIX.idx); a .bin or .idx path also works")
    i.add_argument("--tokenizer-model", help="decode with this tokenizer (else token ids are printed)")
    i.add_argument("--decode", type=int, nargs="*", default=[], metavar="I",
                   help="print documents with these indices (negative counts from the end)")
    i.add_argument("--max-chars", type=int, default=1000, help="truncate each decoded document to this")
    i.add_argument("--bins", type=int, default=12, help="histogram bins (log-spaced)")

    m = verb("merge", "concatenate datasets of the same dtype into one")
    m.add_argument("--inputs", nargs="+", required=True,
                   help="dataset prefixes, in order, or folders (all their .idx datasets, sorted)")
    m.add_argument("--output-prefix", required=True)
    m.add_argument("--overwrite", action="store_true")
    return top


def _input_args(p) -> None:
    p.add_argument("--input", nargs="+", required=True,
                   help="files, globs (quote them) or directories; .jsonl/.json, .txt/.md/.rst, .parquet, "
                   "or a `datasets` save_to_disk folder")
    p.add_argument("--input-format", choices=("jsonl", "text", "parquet", "hf"),
                   help="force the format instead of guessing from the file name")
    p.add_argument("--text-unit", choices=("file", "line"), default="file",
                   help="for text files: one document per file (default) or per line")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .indexed import IndexedFormatError
    from .storage import EXIT_STORAGE, StorageError
    from .sources import InputError

    try:
        return {"corpus": _corpus, "train-tokenizer": _train_tokenizer, "preprocess": _preprocess,
                "inspect": _inspect, "merge": _merge}[args.verb](args)
    except (InputError, IndexedFormatError, ValueError, FileNotFoundError, IndexError) as e:
        print(f"pretrain-data {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pretrain-data {args.verb}: interrupted", file=sys.stderr)
        return 130
    except StorageError as e:  # finished partitions of a preprocess are kept: the same command resumes
        print(f"pretrain-data {args.verb}: error: {e}; run the same command again once the storage is fixed",
              file=sys.stderr)
        return EXIT_STORAGE


def _corpus(args) -> int:
    from .corpus import write_embedded_corpus

    s = write_embedded_corpus(args.output)
    for split in ("train", "valid"):
        print(f"{s[split]['path']}: {s[split]['documents']:,} documents, {s[split]['characters']:,} characters")
    print(f"sha256 {s['sha256']}")
    return 0


def _train_tokenizer(args) -> int:
    import time

    from .sources import iter_texts
    from .tokenizer import load_tokenizer, train_sentencepiece

    t0 = time.perf_counter()
    texts = iter_texts(args.input, args.json_key, args.input_format, args.text_unit)
    path = train_sentencepiece(texts, args.output_prefix, args.vocab_size, model_type=args.model_type,
                               character_coverage=args.character_coverage,
                               input_sentence_size=args.max_sentences, num_threads=args.threads)
    tok = load_tokenizer(path)
    print(f"wrote {path} ({args.model_type}, vocab {tok.vocab_size}) in {time.perf_counter() - t0:.1f} s; "
          f"special ids {tok.special_ids()}")
    return 0


def _preprocess(args) -> int:
    from .preprocess import PreprocessConfig, preprocess
    from .storage import storage_operation

    cfg = PreprocessConfig(
        inputs=args.input, output_prefix=args.output_prefix, tokenizer=args.tokenizer_model,
        json_keys=tuple(args.json_keys), workers=args.workers, append_eod=args.append_eod,
        input_format=args.input_format, text_unit=args.text_unit, dtype=args.dtype,
        chunk_mb=args.chunk_mb, partition_mb=args.partition_mb, overwrite=args.overwrite,
        strict=args.strict, progress=args.progress, stats_json=args.stats_json, eos_token=args.eos_token,
    )
    try:
        with storage_operation(f"preprocessing into {args.output_prefix}", args.output_prefix):
            preprocess(cfg)
    except KeyboardInterrupt:
        print("interrupted: finished partitions are kept; run the same command again to resume",
              file=sys.stderr)
        return 130
    return 0


def _inspect(args) -> int:
    from .inspect import describe

    print(describe(args.prefix, args.tokenizer_model, args.decode, args.bins, args.max_chars))
    return 0


def _merge(args) -> int:
    from .merge import merge

    merge(args.inputs, args.output_prefix, overwrite=args.overwrite, log=print)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# The quickstart: set up .venv, then the whole path on the embedded corpus (the Python standard
# library's own documentation, extracted from this interpreter; nothing is downloaded):
# train a tokenizer, tokenize into megatron's .bin/.idx, train a tiny Transformer++ for a few hundred
# steps, evaluate it against the unigram entropy of the validation tokens, and print a sample.
# Data goes under data/quickstart/; the run directory runs/quickstart/ is recreated each time.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup_env.sh
export PATH="$PWD/.venv/bin:$PATH"
OUT=data/quickstart
pretrain-data corpus --output $OUT/corpus
pretrain-data train-tokenizer --input $OUT/corpus/train.jsonl --vocab-size 4096 --output-prefix $OUT/tok/spm
for split in train valid; do
  pretrain-data preprocess --input $OUT/corpus/$split.jsonl --tokenizer-model $OUT/tok/spm.model \
      --output-prefix $OUT/$split --workers 2 --overwrite --no-progress
done
pretrain-data inspect $OUT/train_text_document
rm -rf runs/quickstart
pretrain train baseline/tiny
pretrain eval runs/quickstart --batches 40 --unigram-entropy
pretrain generate runs/quickstart --prompt "The list type" --max-tokens 60 --top-k 40 --temperature 0.8

#!/usr/bin/env bash
# The quickstart: set up .venv, then the data path on the embedded corpus (the Python standard
# library's own documentation): extract it, train a tokenizer, tokenize it into megatron's .bin/.idx
# format and inspect the result. Everything it writes goes under data/quickstart/.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup_env.sh
export PATH="$PWD/.venv/bin:$PATH"
OUT=data/quickstart
pretrain-data corpus --output $OUT/corpus
pretrain-data train-tokenizer --input $OUT/corpus/train.jsonl --vocab-size 4096 --output-prefix $OUT/tok/spm
for split in train valid; do
  pretrain-data preprocess --input $OUT/corpus/$split.jsonl --tokenizer-model $OUT/tok/spm.model \
      --output-prefix $OUT/$split --workers 2 --overwrite
done
pretrain-data inspect $OUT/train_text_document --tokenizer-model $OUT/tok/spm.model --decode 0 --max-chars 400

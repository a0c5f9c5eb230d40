"""A sentencepiece BPE model as a Hugging Face fast tokenizer (`tokenizer.json`), so that an exported
folder loads with `transformers` and `tokenizers` alone (no sentencepiece, no protobuf).

Read through sentencepiece's own API (no protobuf): the pieces, their scores and kinds. The BPE merges
are recovered from the vocabulary, as sentencepiece ranks them: a piece that splits into two
pieces of the vocabulary is their merge, ranked by the piece's id. The normalizer is ours (identity,
spaces kept, a "▁" prefix: data_tools/tokenizer.py trains with add_dummy_prefix and no whitespace
folding), byte fallback covers unseen characters, and the decoder undoes both. The ids equal
sentencepiece's on text with unicode, runs of spaces, tabs and newlines (tests/test_hf_llama.py).
One difference stays: transformers registers the special tokens (<s>, </s>, ...) as added tokens,
so the literal text "<s>" becomes that token there, while our tokenizer spells it out.
"""
from __future__ import annotations


def sentencepiece_to_hf(path: str):
    """tokenizers.Tokenizer equal to the sentencepiece BPE model at `path`; None for a unigram model (its
    conversion is not written yet: a caller ships the .model alone)."""
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, models, normalizers

    sp = spm.SentencePieceProcessor(model_file=path)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {p: i for i, p in enumerate(pieces)}
    special = lambda i: sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i)  # noqa: E731
    normal = [i for i in range(len(pieces)) if not special(i)]
    scores = [sp.get_score(i) for i in normal]
    if any(a < b for a, b in zip(scores, scores[1:])):  # BPE stores minus the merge rank: never rising
        return None
    merges = sorted((vocab[p], vocab[p[:k]], vocab[p[k:]]) for i in normal for p in [pieces[i]]
                    for k in range(1, len(p))
                    if p[:k] in vocab and p[k:] in vocab and not special(vocab[p[:k]]) and not special(vocab[p[k:]]))
    model = models.BPE(vocab, [(pieces[a], pieces[b]) for _, a, b in merges], unk_token=pieces[sp.unk_id()],
                       byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok

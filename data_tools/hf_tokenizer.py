"""A sentencepiece model (BPE or unigram) as a Hugging Face fast tokenizer (`tokenizer.json`), so that an exported
folder loads with `transformers` and `tokenizers` alone (no sentencepiece, no protobuf).

Read through sentencepiece's own API (no protobuf): the pieces, their scores and kinds. The BPE merges
are recovered from the vocabulary, as sentencepiece ranks them: a piece that splits into two
pieces of the vocabulary is their merge, ranked by the piece's id. A unigram model is its pieces and
scores as they are (the same Viterbi segmentation; control, unknown and byte pieces keep their ids but
are never chosen for text). The normalizer is ours (identity,
spaces kept, a "▁" prefix: data_tools/tokenizer.py trains with add_dummy_prefix and no whitespace
folding), byte fallback covers unseen characters, and the decoder undoes both. The ids equal
sentencepiece's on text with unicode, runs of spaces, tabs and newlines (tests/test_hf_llama.py, both model types).
The literal text "<s>" stays text, as in ours: the exporter's tokenizer_config.json sets
split_special_tokens, or transformers would read it as the special token.
"""
from __future__ import annotations


def sentencepiece_to_hf(path: str):
    """tokenizers.Tokenizer equal to the sentencepiece model (BPE or unigram) at `path`."""
    import sentencepiece as spm
    from tokenizers import Tokenizer, models

    sp = spm.SentencePieceProcessor(model_file=path)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {p: i for i, p in enumerate(pieces)}
    special = lambda i: sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i)  # noqa: E731
    normal = [i for i in range(len(pieces)) if not special(i)]
    kind = model_type(sp.serialized_model_proto())
    if kind not in ("bpe", "unigram"):
        raise ValueError(f"{path}: a sentencepiece {kind} model has no Hugging Face conversion here (bpe and unigram do)")
    if kind == "unigram":
        # special pieces never win a segmentation of text (sentencepiece never matches them either)
        model = models.Unigram([(p, -1e9 if special(i) else sp.get_score(i)) for i, p in enumerate(pieces)],
                               unk_id=sp.unk_id(), byte_fallback=True)
        return _finish(Tokenizer(model))
    merges = sorted((vocab[p], vocab[p[:k]], vocab[p[k:]]) for i in normal for p in [pieces[i]]
                    for k in range(1, len(p))
                    if p[:k] in vocab and p[k:] in vocab and not special(vocab[p[:k]]) and not special(vocab[p[k:]]))
    model = models.BPE(vocab, [(pieces[a], pieces[b]) for _, a, b in merges], unk_token=pieces[sp.unk_id()],
                       byte_fallback=True, fuse_unk=True)
    return _finish(Tokenizer(model))


def model_type(proto: bytes) -> str:
    """The model type stored in a serialized sentencepiece ModelProto, read without protobuf: the varint
    field 3 (model_type) of the message in field 2 (trainer_spec); unigram when unset, as in the proto."""
    def fields(buf: bytes):
        i = 0
        while i < len(buf):
            key, i = _varint(buf, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, i = _varint(buf, i)
            elif wire == 2:
                n, i = _varint(buf, i)
                value, i = buf[i:i + n], i + n
            elif wire in (1, 5):
                value, i = None, i + (8 if wire == 1 else 4)
            else:
                raise ValueError(f"not a sentencepiece model (wire type {wire})")
            yield number, value

    spec = next((v for n, v in fields(proto) if n == 2), b"")
    kind = next((v for n, v in fields(spec) if n == 3), 1)
    return {1: "unigram", 2: "bpe", 3: "word", 4: "char"}.get(kind, f"type-{kind}")


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        value, shift, i = value | (b & 0x7F) << shift, shift + 7, i + 1
        if b < 0x80:
            return value, i


def _finish(tok):
    """Our normalizer (a "▁" prefix, spaces as "▁") and the decoder that undoes it and byte fallback."""
    from tokenizers import decoders, normalizers

    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok

"""One tokenizer interface over sentencepiece `.model` and Hugging Face `tokenizer.json` files, and
deterministic, atomic sentencepiece training.

Models trained here have fixed ids the model code relies on: 0 <unk>, 1 <s>, 2 </s> (eos = end of
document), 3 <pad>, 4 <predict> (SPS architecture). They are *control* symbols, so text spelling
"<predict>" or "</s>" inside a document is encoded as text; HFTokenizer does the same for its special
tokens. No document can forge a document boundary.

sentencepiece and tokenizers are imported lazily so that the CLI starts fast.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import os
import random
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from .errors import first_line
from .files import atomic_write

SPECIAL_PIECES = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}
PREDICT_PIECE = "<predict>"
PREDICT_ID = 4  # right after unk/bos/eos/pad
MODEL_TYPES = ("bpe", "unigram")
BYTE_PIECES = 256  # byte_fallback adds <0x00>..<0xFF>

# Names looked for among a Hugging Face tokenizer's added tokens, in order of preference.
HF_NAMES = {
    "eos": ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>"),
    "bos": ("<s>", "<|begin_of_text|>", "<bos>"),
    "pad": ("<pad>", "<|pad|>"),
    "predict": (PREDICT_PIECE,),
}

# Options train_sentencepiece sets itself; letting extra_options change them would break the fixed ids
# or the streaming/atomic write.
_RESERVED_OPTIONS = {"unk_id", "bos_id", "eos_id", "pad_id", "unk_piece", "bos_piece", "eos_piece",
                     "pad_piece", "control_symbols", "model_prefix", "input", "sentence_iterator",
                     "model_writer", "input_sentence_size", "shuffle_input_sentence"}


class Tokenizer(ABC):
    """What the rest of the code may rely on. Ids that a tokenizer lacks are None (never -1).

    Overrides name the token to use for eos/bos/pad/<predict> (any token of the vocabulary) instead
    of the tokenizer's own choice."""

    def __init__(self, path: str | os.PathLike, *, eos_token: str | None = None,
                 bos_token: str | None = None, pad_token: str | None = None,
                 predict_token: str | None = None):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"{self.path}: no such file")
        self._fingerprint: str | None = None
        self._open()
        self.unk_id: int | None = self._default("unk")
        self.bos_id: int | None = self._lookup(bos_token) if bos_token else self._default("bos")
        self.pad_id: int | None = self._lookup(pad_token) if pad_token else self._default("pad")
        self.predict_id: int | None = (self._lookup(predict_token) if predict_token
                                       else self._default("predict"))
        eos = self._lookup(eos_token) if eos_token else self._default("eos")
        if eos is None:
            raise ValueError(f"{self.path}: the tokenizer has no end-of-document token (looked for "
                             f"{self._eos_candidates}); name one with eos_token='<token>' (--eos-token)")
        self.eos_id: int = eos

    _eos_candidates = ""  # how _default("eos") searched, for the error message

    @abstractmethod
    def _open(self) -> None:
        """Load self.path; raise ValueError naming it if it is not this kind of tokenizer."""

    @abstractmethod
    def _default(self, name: str) -> int | None:
        """The tokenizer's own id for "unk", "bos", "eos", "pad" or "predict", if it has one."""

    @abstractmethod
    def _token_id(self, token: str) -> int | None:
        """Id of a token of the vocabulary, None if there is no such token."""

    def _lookup(self, token: str) -> int:
        i = self._token_id(token)
        if i is None:
            raise ValueError(f"{self.path}: no token {token!r} in the vocabulary")
        return i

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids (max id + 1), i.e. what embedding tables and token dtypes must hold."""

    @property
    def eod_id(self) -> int:
        """The id appended after every document."""
        return self.eos_id

    def special_ids(self) -> dict[str, int | None]:
        return {"unk": self.unk_id, "bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id,
                "predict": self.predict_id}

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without bos/eos."""

    @abstractmethod
    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Same as [self.encode(t) for t in texts], faster."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens decode to nothing."""

    @abstractmethod
    def id_to_token(self, i: int) -> str | None:
        """The token (piece) with id i, as the tokenizer spells it (None outside the vocabulary)."""

    def fingerprint(self) -> str:
        """sha256 hex of the model file's bytes, the key caches store preprocessed data under.
        Overrides (eos_token=...) are not part of it: callers that depend on them key on the ids too."""
        if self._fingerprint is None:
            with open(self.path, "rb") as f:
                self._fingerprint = hashlib.file_digest(f, "sha256").hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def _check_threads(num_threads: int) -> None:
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive integer, got {num_threads!r}")


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model`."""

    _eos_candidates = "the model's eos_id"

    def _open(self) -> None:
        import sentencepiece as spm

        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.path)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{self.path}: not a sentencepiece model ({first_line(e)})") from None

    def _default(self, name: str) -> int | None:
        if name == "predict":
            return self._token_id(PREDICT_PIECE)
        i = getattr(self._sp, f"{name}_id")()
        return i if i >= 0 else None  # sentencepiece reports a disabled special as -1

    def _token_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)  # answers unk_id for an unknown piece: check it round-trips
        return i if self._sp.id_to_piece(i) == token else None

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int, add_bos=False, add_eos=False)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        _check_threads(num_threads)
        return self._sp.encode(list(texts), out_type=int, add_bos=False, add_eos=False,
                               num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_token(self, i: int) -> str | None:
        return self._sp.id_to_piece(i) if 0 <= i < self.vocab_size else None


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`. Special tokens are found among its added tokens by the
    common names in HF_NAMES."""

    _eos_candidates = ", ".join(HF_NAMES["eos"])

    def _open(self) -> None:
        from tokenizers import Tokenizer as Backend

        try:
            self._tok = Backend.from_file(self.path)
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"{self.path}: not a Hugging Face tokenizer.json ({first_line(e)})") from None
        added = self._tok.get_added_tokens_decoder()  # id -> AddedToken
        self._added = {t.content: i for i, t in added.items()}
        # Text that happens to spell a special token ("<|endoftext|>" in a web page) must be encoded
        # as text: otherwise a document could inject a document boundary.
        self._tok.encode_special_tokens = True
        # Ids may have holes above the model vocabulary; vocab_size must cover the largest id.
        self._vocab_size = max([self._tok.get_vocab_size(with_added_tokens=True)]
                               + [i + 1 for i in added])

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._tok.encode_special_tokens = True  # tokenizers' pickling drops this flag

    def _default(self, name: str) -> int | None:
        if name == "unk":  # BPE/WordPiece/WordLevel models name their unknown token
            unk = getattr(self._tok.model, "unk_token", None)
            return self._token_id(unk) if unk else None
        return next((self._added[n] for n in HF_NAMES[name] if n in self._added), None)

    def _token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """tokenizers sizes its own (rayon) thread pool once per process, from RAYON_NUM_THREADS and
        TOKENIZERS_PARALLELISM, so num_threads cannot resize it. num_threads=1 encodes sequentially
        instead, which keeps one-thread-per-worker pipelines from oversubscribing the cores."""
        _check_threads(num_threads)
        texts = list(texts)
        if num_threads == 1:
            return [self._tok.encode(t, add_special_tokens=False).ids for t in texts]
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: no offsets
        return [e.ids for e in batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)


def _resolve_path(path: Path) -> Path:
    """The tokenizer file `path` names: itself, or the single tokenizer file in a directory."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if not path.is_dir():
        return path
    models = [path / "tokenizer.model"] if (path / "tokenizer.model").is_file() else \
        sorted(p for p in path.glob("*.model") if p.is_file())
    jsons = [path / "tokenizer.json"] if (path / "tokenizer.json").is_file() else []
    found = models + jsons
    if not found:
        raise ValueError(f"{path}: directory holds no tokenizer (no tokenizer.model, *.model or "
                         f"tokenizer.json)")
    if len(found) > 1:
        raise ValueError(f"{path}: directory holds several tokenizers "
                         f"({', '.join(p.name for p in found)}); pass the file to use")
    return found[0]


def load_tokenizer(path: str | os.PathLike, **overrides) -> Tokenizer:
    """Load a sentencepiece `.model`, a Hugging Face `tokenizer.json` (any `*.json`), or a directory
    holding exactly one of them. `overrides`: eos_token, bos_token, pad_token, predict_token."""
    file = _resolve_path(Path(path))
    if file.suffix == ".model":
        return SentencePieceTokenizer(file, **overrides)
    if file.suffix == ".json":
        return HFTokenizer(file, **overrides)
    raise ValueError(f"{file}: unknown tokenizer kind (expected a sentencepiece .model or a "
                     f"Hugging Face tokenizer.json)")


def _split_long(line: str, max_bytes: int) -> Iterator[str]:
    """Pieces of `line` of at most max_bytes UTF-8 bytes (sentencepiece drops longer sentences).
    Cuts at the last space in the window when there is one far enough in, else mid-word on a
    character boundary."""
    data = line.encode("utf-8", "surrogatepass")
    while len(data) > max_bytes:
        cut = data.rfind(b" ", 0, max_bytes + 1)
        if cut > max_bytes // 2:
            piece, data = data[:cut], data[cut + 1:]  # the space itself is a separator: drop it
        else:
            cut = max_bytes
            while data[cut] & 0xC0 == 0x80:  # never split inside a UTF-8 character
                cut -= 1
            piece, data = data[:cut], data[cut:]
        if piece.strip():
            yield piece.decode("utf-8", "surrogatepass")
    if data.strip():
        yield data.decode("utf-8", "surrogatepass")


def _training_lines(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Documents -> the non-empty lines sentencepiece trains on, split to fit max_bytes."""
    for text in texts:
        for line in text.split("\n"):
            line = line.rstrip("\r")
            if not line.strip():
                continue
            # len(line) * 4 bounds its UTF-8 size: most lines skip the encode in _split_long.
            if len(line) * 4 <= max_bytes:
                yield line
            else:
                yield from _split_long(line, max_bytes)


def _sample(lines: Iterator[str], size: int, shuffle: bool, seed: int) -> Iterator[str]:
    """At most `size` lines: a uniform reservoir sample, or the first `size` lines.

    Done here rather than by sentencepiece's own input_sentence_size, whose sample changed from run
    to run even after set_random_generator_seed (sentencepiece 0.2.3); this one is reproducible."""
    if not shuffle:
        return itertools.islice(lines, size)
    rng, reservoir = random.Random(seed), []
    for n, line in enumerate(lines):
        if n < size:
            reservoir.append(line)
        else:
            j = rng.randrange(n + 1)
            if j < size:
                reservoir[j] = line
    return iter(reservoir)


def train_sentencepiece(texts: Iterable[str], output_prefix: str | os.PathLike, vocab_size: int,
                        model_type: str = "bpe", *, character_coverage: float = 0.9995,
                        max_sentence_length: int = 4192, input_sentence_size: int = 0,
                        shuffle_input_sentence: bool = True, seed: int = 0, num_threads: int = 2,
                        byte_fallback: bool = True, extra_options: dict | None = None,
                        verbose: bool = False) -> str:
    """Train a sentencepiece model on `texts` (documents, streamed) and write `<prefix>.model` and
    `<prefix>.vocab`; returns the `.model` path.

    Ids 0-4 are <unk> <s> </s> <pad> <predict>. Documents are split into lines; lines longer than
    max_sentence_length bytes are split further rather than dropped; blank lines are skipped.
    input_sentence_size > 0 trains on that many lines, sampled with `seed` (or the first ones when
    shuffle_input_sentence is False). Normalization is the identity and whitespace is kept, so
    decode(encode(text)) == text (byte_fallback covers unseen characters, newlines included).

    Determinism: the same texts and options give a byte-identical model. num_threads is one of the
    options: it is stored in the model, and unigram training sums in a thread-dependent order, so
    unigram pieces can differ between thread counts (BPE pieces did not in our tests).

    Both files are written under temporary names beside the output and renamed into place, so a
    crash never leaves a half-written `.model` at `output_prefix`.
    """
    prefix = str(output_prefix)
    if prefix.endswith(".model"):  # accept "out/tok.model" for "out/tok"
        prefix = prefix[: -len(".model")]
    _check_training_options(vocab_size, model_type, character_coverage, max_sentence_length, input_sentence_size,
                            num_threads, byte_fallback, extra_options)
    stream, failure = _training_stream(prefix, texts, max_sentence_length, input_sentence_size,
                                       shuffle_input_sentence, seed)
    options = _trainer_options(vocab_size, model_type, character_coverage, max_sentence_length, num_threads,
                               byte_fallback, extra_options, verbose)
    import sentencepiece as spm

    # model_writer returns the model instead of writing <model_prefix>.model: the model records its
    # model_prefix, so training under a unique temporary prefix would make every model differ.
    buffer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=stream(), model_writer=buffer, **options)
    except RuntimeError as e:
        if failure:
            raise failure[0] from None
        raise _training_error(prefix, vocab_size, e) from None
    return _write_model(prefix, buffer.getvalue())


def _check_training_options(vocab_size, model_type: str, character_coverage: float, max_sentence_length: int,
                            input_sentence_size: int, num_threads: int, byte_fallback: bool,
                            extra_options: dict | None) -> None:
    """Refuse train_sentencepiece's bad options before any text is read, with what to change."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model_type {model_type!r}; expected one of {', '.join(MODEL_TYPES)}")
    reserved = len(SPECIAL_PIECES) + 1 + (BYTE_PIECES if byte_fallback else 0)
    if not isinstance(vocab_size, int) or vocab_size <= reserved:
        raise ValueError(f"vocab_size {vocab_size} is too small: the 5 special tokens"
                         f"{' and 256 byte-fallback pieces' if byte_fallback else ''} already take "
                         f"{reserved} ids; use a vocab_size well above {reserved}")
    if not 0 < character_coverage <= 1:
        raise ValueError(f"character_coverage must be in (0, 1], got {character_coverage}")
    if max_sentence_length < 10:  # sentencepiece's own lower bound
        raise ValueError(f"max_sentence_length must be at least 10 bytes, got {max_sentence_length}")
    if input_sentence_size < 0:
        raise ValueError(f"input_sentence_size must be >= 0 (0 = all), got {input_sentence_size}")
    if _RESERVED_OPTIONS & set(extra_options or {}):
        raise ValueError(f"extra_options may not set "
                         f"{', '.join(sorted(_RESERVED_OPTIONS & set(extra_options)))}")
    _check_threads(num_threads)


def _training_stream(prefix: str, texts: Iterable[str], max_sentence_length: int, input_sentence_size: int,
                     shuffle: bool, seed: int):
    """(stream, failure): stream() yields the training lines; failure receives the exception that stopped
    it, if any. Raises at once when there is no text at all."""
    lines = _training_lines(texts, max_sentence_length)
    if input_sentence_size:
        lines = _sample(lines, input_sentence_size, shuffle, seed)
    first = next(lines, None)  # fail early and clearly instead of sentencepiece's bare check
    if first is None:
        raise ValueError(f"{prefix}: no text to train on (every document is empty)")

    # sentencepiece turns an exception raised by our iterator into a RuntimeError with a traceback
    # in its text; keep the original (e.g. KeyboardInterrupt, a reader's format error) to re-raise.
    failure: list[BaseException] = []

    def stream() -> Iterator[str]:
        try:
            yield first
            yield from lines
        except GeneratorExit:  # closed by the garbage collector after training: not a failure
            raise
        except BaseException as e:
            failure.append(e)
            raise
    return stream, failure


def _trainer_options(vocab_size: int, model_type: str, character_coverage: float, max_sentence_length: int,
                     num_threads: int, byte_fallback: bool, extra_options: dict | None, verbose: bool) -> dict:
    """SentencePieceTrainer's options: the fixed special ids, lossless text, and extra_options on top."""
    options = dict(
        model_type=model_type, vocab_size=vocab_size, character_coverage=character_coverage,
        max_sentence_length=max_sentence_length, num_threads=num_threads, byte_fallback=byte_fallback,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, unk_piece="<unk>", bos_piece="<s>",
        eos_piece="</s>", pad_piece="<pad>", control_symbols=[PREDICT_PIECE],
        # Lossless text: no NFKC, keep runs of spaces and indentation (code), allow pieces of spaces.
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        input_sentence_size=0, shuffle_input_sentence=False,  # sampling is done by _training_stream, reproducibly
        minloglevel=0 if verbose else 2,
    )
    options.update(extra_options or {})
    return options


def _write_model(prefix: str, model: bytes) -> str:
    """Check the trained model's special ids, then write `<prefix>.vocab` and `<prefix>.model` atomically."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    pieces = [sp.id_to_piece(i) for i in range(PREDICT_ID + 1)]
    if pieces != [*SPECIAL_PIECES.values(), PREDICT_PIECE]:  # the ids the models rely on
        raise RuntimeError(f"{prefix}: trained model has special pieces {pieces}")
    # .vocab first: the .model appearing is what marks a finished training.
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    atomic_write(prefix + ".vocab", _vocab_text(sp))
    atomic_write(prefix + ".model", model)
    return prefix + ".model"


def _vocab_text(sp) -> str:
    """The `.vocab` sentencepiece writes beside a model: "piece<TAB>score" per id (%g = C++'s format)."""
    return "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))


def _training_error(prefix: str, vocab_size: int, error: RuntimeError) -> Exception:
    """sentencepiece's check failures -> one line saying what to change."""
    text = first_line(error)
    if "Vocabulary size too high" in text or "Vocabulary size is too high" in text:
        limit = re.search(r"<= (\d+)", text)
        most = f" (this text allows at most {limit.group(1)})" if limit else ""
        return ValueError(f"{prefix}: vocab_size {vocab_size} is too high for this text{most}; "
                          f"lower --vocab-size or give more text")
    if "smaller than required_chars" in text:
        need = re.search(r"vs (\d+)", text)
        least = f" (this text needs at least {need.group(1)})" if need else ""
        return ValueError(f"{prefix}: vocab_size {vocab_size} cannot hold every character of the "
                          f"text{least}; raise --vocab-size or lower character_coverage")
    return RuntimeError(f"{prefix}: sentencepiece training failed: {text}")

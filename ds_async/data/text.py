"""What counts as a usable document and how it becomes tokens: the tokenizer read from a file or the hub
(:func:`load_tokenizer`), a batch encoder and the EOS id, the skip reasons (:func:`usable_text`), a huge document
cut into pieces, and the digest that identifies a held-out document.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterator

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from ..config import ConfigError
from ..hub import one_line, refuse_remote_code
from .sources import EOS_TOKEN, DataError, read_rows

def load_tokenizer(spec: str, key: str | None = None) -> PreTrainedTokenizerFast:
    """Load a tokenizer.json file, or a directory / hub name through AutoTokenizer (never running code of its own:
    a folder with ``auto_map`` is refused); it must define an EOS token. With ``key`` (the config key, e.g.
    ``ds_async.tokenizer``) every failure is a one-line ConfigError naming it and ``spec``."""

    where = f"{key}: {spec}" if key else spec
    try:
        if spec.endswith(".json"):
            if not os.path.isfile(spec):
                raise FileNotFoundError(f"no tokenizer file {spec!r}")
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=spec)
            # A bare tokenizer.json has no config naming its EOS; ours (see ds_async.tokenizer) reserve EOS_TOKEN.
            if EOS_TOKEN in tokenizer.get_vocab():
                tokenizer.eos_token = EOS_TOKEN
        else:
            # transformers' auto classes import its model registry (seconds), which a reader process never needs
            from transformers import AutoTokenizer

            refuse_remote_code(spec, where)
            tokenizer = AutoTokenizer.from_pretrained(spec, trust_remote_code=False)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a missing file, an unreachable hub name, a file tokenizers rejects
        if key is None:
            raise
        raise ConfigError(f"{where}: cannot load the tokenizer ({one_line(e)})") from None
    try:
        eos_id(tokenizer)
    except ValueError as e:
        if key is None:
            raise
        raise ConfigError(f"{key}: {e}") from None
    return tokenizer


def document_encoder(tokenizer) -> Callable[[list[str]], list[list[int]]]:
    """A function from documents to their token ids, equal to ``tokenizer(texts, add_special_tokens=False,
    split_special_tokens=True)["input_ids"]`` (a literal ``<|endoftext|>`` in a document is text, not a boundary).

    For a tokenizer with a Rust backend it encodes with a copy of that backend, set up once as that call sets it up
    (no truncation, no padding, special tokens split) and without computing character offsets
    (``encode_batch_fast``), which the call computes and a stream throws away (the CHANGELOG has the gain). The
    copy is this function's own, so a stream read in a background thread shares no settings with the caller's
    tokenizer, which the call would set on every use."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python or SentencePiece tokenizer: the call itself
        return lambda texts: tokenizer(texts, add_special_tokens=False, split_special_tokens=True,
                                       return_attention_mask=False)["input_ids"]
    backend = Tokenizer.from_str(backend.to_str())
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = True
    return lambda texts: [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]


def eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token to separate documents")
    return tokenizer.eos_token_id


SKIP_REASONS = ("empty", "short", "non_utf8", "not_text")
HELD_OUT = "held_out"  # a further skip reason, counted only by streams with held-out documents
COUNTED_REASONS = (*SKIP_REASONS, HELD_OUT)
REPLACEMENT_CHAR = "\ufffd"
# What a document of no text holds: C0 control characters (NUL first: a zero-filled file is valid UTF-8), DEL and
# whitespace. Stripped from both ends only, so a real document costs a look at its first character.
_NOT_TEXT_CHARS = "".join(map(chr, range(32))) + "\x7f \u00a0\u2028\u2029\ufeff"


def usable_text(value, min_chars: int) -> tuple[str | None, str | None]:
    """``(text, None)`` for a document to train on, else ``(None, reason)`` (one of ``SKIP_REASONS``)."""
    if value is None:
        return None, "empty"
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None, "non_utf8"
    if not isinstance(value, str):
        return None, "not_text"
    if not value or value.isspace():
        return None, "empty"
    if not value.strip(_NOT_TEXT_CHARS):
        return None, "not_text"  # NUL or other control characters only
    if not value.isascii() and REPLACEMENT_CHAR in value:
        return None, "non_utf8"  # a text-file line whose bytes were not UTF-8 (decoded with errors="replace")
    if min_chars > 1 and _visible_chars(value, min_chars) < min_chars:
        return None, "short"
    return value, None


PIECE_CHARS = 1 << 18
"""Documents longer than this many characters are tokenized in pieces of at most this many, as the token buffer
needs them (:func:`next_piece`), so that neither tokenizing nor the token buffer grows with a document's length (a
100 MB line tokenized at once took 6.2 GiB); the stream's state holds the document's untokenized rest as text."""


def next_piece(text: str, start: int, size: int = PIECE_CHARS) -> int:
    """Where the piece of ``text`` that starts at ``start`` ends: ``len(text)`` if at most ``size`` characters are
    left, else just before the last newline, or failing that the last whitespace, in the second half of the next
    ``size`` characters, or failing both after ``size`` characters. A byte-level BPE splits words from the
    whitespace before them, so pieces cut before whitespace tokenize as the whole text does; a cut that falls
    inside a run the tokenizer would not split (``size`` characters without whitespace) changes the tokens there."""
    end = start + size
    if end >= len(text):
        return len(text)
    lo = start + size // 2
    for sep in ("\n", " ", "\t"):
        cut = text.rfind(sep, lo, end)
        if cut > start:
            return cut
    return end


def _visible_chars(text: str, enough: int) -> int:
    """The non-whitespace characters of ``text``, counted until ``enough`` (a long document is not split whole)."""
    count = 0
    for word in re.finditer(r"\S+", text):
        count += word.end() - word.start()
        if count >= enough:
            break
    return count


def usable_texts(stream, text_field: str, min_chars: int = 1) -> Iterator[str]:
    """The documents of ``stream`` that training reads (``usable_text``), in order: a tokenizer's training text."""
    for row in read_rows(stream):
        text = usable_text(row.get(text_field), min_chars)[0]
        if text is not None:
            yield text


NON_UTF8_REFUSED, NON_UTF8_WARNED = 0.5, 0.1
"""Shares of non-UTF-8 documents among those read at start that stop the job / print a warning."""


def check_encoding(documents: int, non_utf8: int, where: str) -> str | None:
    """The verdict on ``non_utf8`` of the first ``documents`` documents of source ``where`` (config key and
    source): DataError from half of them (not UTF-8 text: binary data, or another encoding), a warning line from a
    tenth (the rest trains, those are skipped), else None."""
    if not documents or non_utf8 < NON_UTF8_WARNED * documents:
        return None
    what = f"{where}: {non_utf8} of the first {documents} documents are not valid UTF-8"
    if non_utf8 >= NON_UTF8_REFUSED * documents:
        raise DataError(f"{what}; this is not UTF-8 text (binary data, or another encoding: convert it to UTF-8)")
    return f"ds_async: warning: {what} and are skipped (another encoding, or binary data mixed in?)"


def text_digest(text: str) -> bytes:
    """What identifies a held-out document: a 16-byte BLAKE2b digest of its text."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

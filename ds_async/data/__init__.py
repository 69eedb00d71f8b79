"""Text datasets -> token stream -> packed, resumable micro-batches for causal-LM pretraining.

:func:`open_batches` is the entry: for ``ds_async.data`` and a role (``train`` or ``validation``) it resolves the
source (an embedded corpus, local files, an ``hf://`` path or a hub dataset, read as a ``datasets`` stream) and
returns a :class:`PackedBatches`, one data-parallel rank's iterator of ``(input_ids, labels)`` micro-batches:
documents tokenized, each ended by EOS, packed back to back into rows of ``seq_len`` (every token an input exactly
once), ranks reading disjoint documents. Unusable documents are skipped and counted by reason
(:func:`usable_text`). ``state_dict`` / ``load_state_dict`` resume a stream exactly where it stood. Errors name
the config key: ConfigError for the config, DataError or FileNotFoundError for the data.

Its parts: :mod:`.sources` (where the text comes from, opened as a stream of rows), :mod:`.text` (what counts as a
usable document and how it becomes tokens), :mod:`.packing` (documents -> micro-batches, resumable). The names
below are the pipeline's API for the jobs, the tokenizer's room and the tests.
"""
from .packing import PackedBatches, open_batches, open_replica_streams
from .sources import (EMBEDDED_CORPUS, EMBEDDED_PREFIXES, EOS_TOKEN, LEE_CORPUS, DataError, describe,
                      load_text_stream, resolve_files, resolve_source)
from .text import (PIECE_CHARS, SKIP_REASONS, check_encoding, document_encoder, eos_id, load_tokenizer, usable_text,
                   usable_texts)

__all__ = ["PackedBatches", "open_batches", "open_replica_streams", "EMBEDDED_CORPUS", "EMBEDDED_PREFIXES",
           "EOS_TOKEN", "LEE_CORPUS", "DataError", "describe", "load_text_stream", "resolve_files", "resolve_source",
           "PIECE_CHARS", "SKIP_REASONS", "check_encoding", "document_encoder", "eos_id", "load_tokenizer",
           "usable_text", "usable_texts"]

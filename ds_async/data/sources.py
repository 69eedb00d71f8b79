"""Where the text comes from: a source of ``ds_async.data`` (an embedded corpus, local files, an ``hf://`` path or a
hub dataset) resolved, checked and opened as a ``datasets`` stream of rows (:func:`load_text_stream`), with the
errors naming the config key (ConfigError for the config, DataError or FileNotFoundError for the data), and the
wait at interpreter exit for arrow's reader threads (:func:`read_rows`).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import glob
import importlib
import importlib.util
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .. import corpus, hub
from ..config import ConfigError, DataConfig, from_dict
from ..config_sections import DataError, DataSource
from ..corpus import EMBEDDED_CORPUS  # ships with Python itself: the default, nothing to install
from ..hub import one_line

if TYPE_CHECKING:
    import datasets

LEE_CORPUS = "gensim:lee"  # the Lee news corpus inside gensim's wheel (pip install gensim)
EMBEDDED_PREFIXES = ("gensim:", "python:")  # a source so named is an embedded corpus, known or not
EOS_TOKEN = "<|endoftext|>"

# gensim's wheel ships the Lee news corpus (one article per line) as test data. It is ASCII but for one
# Latin-1 pound sign in lee.cor, which UTF-8 decoding rejects.
_LEE_FILES = {"train": "lee_background.cor", "validation": "lee.cor"}
_LEE_ENCODING = "latin-1"
_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text", ".cor": "text"}
_DEFAULT_SPLIT = {"train": "train", "validation": "validation"}

# datasets sleeps config.SLEEP_TIME_ON_THREADS_SHUTDOWN (5 s) whenever an iterator over several shards ends, so that
# arrow's reader threads are gone before the interpreter is (apache/arrow#45214; arrow#39862 reports 100 ms after a
# scan enough). Only interpreter exit needs that: the end of an epoch or a dropped stream does not, and there it
# stalls training and every short job. So the sleep is 0 while a process runs, and at exit the process waits until
# _EXIT_WAIT seconds have passed since it last read a stream. 1 s was not enough on a loaded CPU: a study worker
# (tiny matrix, 2 cores and 3 busy processes) aborted at exit ("terminate called without an active exception") in
# 2 of 8 runs at 1 s and 0 of 10 at 3 s.
_EXIT_WAIT = 3.0
_last_read = [None]  # time.monotonic() of the last row read through this module


@functools.cache
def datasets_library():
    """The ``datasets`` library (with its ``distributed`` and ``packaged_modules``), imported at its first use rather
    than with this package: a training process imports this package among its first imports, and ``datasets``,
    pandas with it, is a slow import that the process's first reads of data pay instead, on a thread beside the
    model's build (``ds_async.trainer_setup``). Set up as above."""
    lib = importlib.import_module("datasets")
    for module in ("datasets.distributed", "datasets.packaged_modules"):
        importlib.import_module(module)
    lib.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    return lib


def _wait_for_reader_threads() -> None:
    if _last_read[0] is not None:
        time.sleep(max(0.0, _EXIT_WAIT - (time.monotonic() - _last_read[0])))


atexit.register(_wait_for_reader_threads)


def read_rows(stream):
    """The rows of a datasets stream, each read noted for the wait at exit (see above); closing this closes the
    stream (``_Documents.close``)."""
    rows = iter(stream)
    try:
        for row in rows:
            _last_read[0] = time.monotonic()
            yield row
    finally:
        if hasattr(rows, "close"):  # datasets' generator: its own cleanup shuts its reader threads down, now
            rows.close()
        # arrow's threads wind down after the stream ends or is closed, as after a read: the exit waits for them too
        _last_read[0] = time.monotonic()


def _builder_for(path: str) -> str | None:
    return _BUILDERS.get(os.path.splitext(path)[1].lower())


def _is_url(path: str) -> bool:
    return "://" in path


def _embedded_file(split: str) -> str:
    if split not in _LEE_FILES:
        raise ValueError(f"{LEE_CORPUS} has splits {sorted(_LEE_FILES)}, not {split!r}")
    # find_spec locates the package without importing it: importing gensim pulls in scipy and takes seconds.
    spec = importlib.util.find_spec("gensim")
    if spec is None:
        raise ModuleNotFoundError(
            f"the corpus {LEE_CORPUS!r} ships with gensim: `pip install gensim` (or use {EMBEDDED_CORPUS!r})"
        )
    return os.path.join(spec.submodule_search_locations[0], "test", "test_data", _LEE_FILES[split])


def resolve_files(source: str | Sequence[str], split: str) -> tuple[str, str | list[str] | None]:
    """Map a data source to (datasets builder name, data_files).

    `source` is an embedded corpus ("python:docs", "gensim:lee"), a path or glob (or a list of them) ending in .parquet, .json,
    .jsonl, .txt or .cor, or else a dataset for ``datasets.load_dataset`` (hub name, ``hf://datasets/owner/name``,
    local folder, builder name), returned as (source, None). Local globs are expanded here; URLs such as
    ``hf://datasets/owner/name@revision/dir/*.parquet`` go to ``datasets`` unchanged, which resolves them.
    """
    if isinstance(source, str):
        if source == EMBEDDED_CORPUS:
            if split not in corpus.SPLITS:
                raise ValueError(f"{EMBEDDED_CORPUS} has splits {list(corpus.SPLITS)}, not {split!r}")
            return "json", str(corpus.corpus_files()[split])
        if source == LEE_CORPUS:
            return "text", _embedded_file(split)
        if source.startswith(EMBEDDED_PREFIXES):
            raise ValueError(f"unknown embedded corpus {source!r}; there are {EMBEDDED_CORPUS!r} and {LEE_CORPUS!r}")
        if _builder_for(source) is None:
            return source, None
        patterns = [source]
    else:
        patterns = list(source)

    builders = {_builder_for(p) for p in patterns}
    if None in builders or len(builders) != 1:
        raise ValueError(f"local data files must share one of the extensions {sorted(_BUILDERS)}: {patterns}")
    files = []
    for pattern in patterns:
        if _is_url(pattern):
            files.append(pattern)
            continue
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            raise FileNotFoundError(f"no data files match {pattern!r}")
        files.extend(matches)
    return builders.pop(), files


def _check_readable(file: str, builder: str) -> None:
    """Fail now, naming the file, rather than deep inside a stream: a folder, an unreadable file, or a parquet
    file whose footer (schema) cannot be read."""
    if os.path.isdir(file):
        raise DataError(f"{file}: is a directory, not a data file")
    try:
        with open(file, "rb") as f:
            f.read(1)
        if builder == "parquet":
            import pyarrow.parquet as pq

            pq.read_schema(file)
    except OSError as e:
        raise DataError(f"{file}: cannot read data file ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a corrupt file
        raise DataError(f"{file}: not a readable {builder} file ({type(e).__name__}: {e})") from None


def describe(source) -> str:
    """A data source in one short line, for messages: the string itself, or the set fields of a DataSource."""
    if isinstance(source, DataSource):
        fields = {k: v for k, v in dataclasses.asdict(source).items() if v is not None}
        path = fields.pop("path", None)
        rest = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        return f"{path} ({rest})" if path and rest else path or f"({rest})"
    if source is None or isinstance(source, str):
        return str(source)
    return ", ".join(map(str, source))


def _is_files(path: str) -> bool:
    """A path that names its files itself (so no config name, data_files, data_dir or revision apply)."""
    return path.startswith(EMBEDDED_PREFIXES) or _builder_for(path) is not None


def resolve_source(data: DataConfig, role: str) -> tuple[DataSource, int]:
    """The dataset that ``data.<role>`` (``train`` or ``validation``) reads, every field filled in, and how many of
    its first documents are held out for validation (``validation.from_train``; 0 without): the training stream
    skips them, the validation stream reads only them. Raises ConfigError naming the key."""
    if role not in _DEFAULT_SPLIT:
        raise ValueError(f"role must be 'train' or 'validation', not {role!r}")
    train = _as_source(data.train, "ds_async.data.train")
    if train.from_train is not None:
        raise ConfigError("ds_async.data.train.from_train: only in ds_async.data.validation")
    if train.path is None:
        raise ConfigError("ds_async.data.train.path: required (a dataset, files or python:docs)")
    train = _filled(train, "train", "ds_async.data.train")
    val = None if data.validation is None else _as_source(data.validation, "ds_async.data.validation")
    held_out = 0
    if val is not None and val.from_train is not None:
        if val.from_train < 1:
            raise ConfigError(f"ds_async.data.validation.from_train: must be >= 1, got {val.from_train}")
        others = [f.name for f in dataclasses.fields(val)
                  if f.name != "from_train" and getattr(val, f.name) is not None]
        if others:
            raise ConfigError(f"ds_async.data.validation.{others[0]}: not with from_train (the held-out documents "
                              "are the first documents of ds_async.data.train)")
        held_out = val.from_train
    if held_out:
        return train, held_out
    if val is None:
        if role == "validation":
            raise ConfigError("ds_async.data.validation: null (no validation data)")
        return train, 0
    if val.path is None:  # another split of the training dataset
        if _is_files(train.path) and not train.path.startswith(EMBEDDED_PREFIXES):
            raise ConfigError("ds_async.data.validation.path: required, since ds_async.data.train "
                              f"({train.path}) names files, which have no splits; name the validation files, or "
                              "hold documents out with from_train")
        val = dataclasses.replace(val, **{f.name: getattr(train, f.name) for f in dataclasses.fields(val)
                                          if f.name != "split" and getattr(val, f.name) is None})
    val = _filled(val, "validation", "ds_async.data.validation")
    return (train, 0) if role == "train" else (val, 0)


def _as_source(value, key: str) -> DataSource:
    if isinstance(value, DataSource):
        return value
    if isinstance(value, str):
        return DataSource(path=value)
    if isinstance(value, dict):  # a DataConfig built in code: parsed as the JSON is
        return from_dict(DataSource, value, key)
    raise ConfigError(f"{key}: expected a string or an object, got {type(value).__name__} {value!r}")


def _filled(src: DataSource, role: str, key: str) -> DataSource:
    """``src`` with its split defaulted, after checking that its fields go together."""
    if src.path is not None and _is_files(src.path):
        for name in ("name", "revision", "data_files", "data_dir"):
            if getattr(src, name) is not None:
                hint = " (an hf:// path takes @revision after the repository name)" if name == "revision" else ""
                raise ConfigError(f"{key}.{name}: does not apply to {src.path!r}, which names its files itself{hint}")
    files = src.data_files
    if isinstance(files, dict):
        for split, patterns in files.items():
            if not (isinstance(patterns, str) or
                    isinstance(patterns, list) and patterns and all(isinstance(p, str) for p in patterns)):
                raise ConfigError(f"{key}.data_files.{split}: expected a file pattern or a list of them, "
                                  f"got {patterns!r}")
    return dataclasses.replace(src, split=src.split or _DEFAULT_SPLIT[role])


def load_text_stream(source: str | Sequence[str] | DataSource, split: str, text_field: str = "text",
                     key: str | None = None) -> datasets.IterableDataset:
    """Stream `split` of `source` as rows holding each document under `text_field`.

    `source` is a string or list (see `resolve_files`) or a DataSource (its own ``split`` and ``text_field``, when
    set, take precedence; one without ``path`` needs the training source: see `open_batches`). `key` (the config
    key, e.g. ``ds_async.data.train``) starts the messages of DataError, FileNotFoundError and ConfigError.
    """
    label = f"{key}: " if key else ""
    src = source if isinstance(source, DataSource) else None
    if src is not None:
        if src.path is None or src.from_train is not None:
            raise ConfigError(f"{key or 'data source'}: {describe(src)} has no path of its own; a validation source "
                              "without one reads data.train's dataset: open it with ds_async.data.open_batches")
        source, split = src.path, src.split or split
    try:
        builder, files = resolve_files(source, split)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{label}{e}") from None
    except ValueError as e:
        raise DataError(f"{label}{e}") from None
    # A dataset name that is neither a local folder nor one of datasets' own builders (parquet, json, ...), or files
    # by hf:// URL: read from the hub.
    own_builders = datasets_library().packaged_modules._PACKAGED_DATASETS_MODULES
    on_hub = (files is None and not os.path.exists(builder) and builder not in own_builders) or any(
        str(f).startswith("hf://") for f in ([files] if isinstance(files, str) else files or []))
    why = hub.unreachable() if on_hub else None
    if why is not None:
        raise DataError(f"{label}{describe(src or source)}: cannot reach the Hugging Face hub ({why}); without a "
                        "network set HF_HUB_OFFLINE=1 to read a dataset from the local cache, or point the key at "
                        "local files")
    if files is None:  # a dataset: load_dataset(path, name=..., revision=..., data_files=..., data_dir=...)
        fields = dataclasses.asdict(src) if src is not None else {}
        kwargs = {k: fields[k] for k in ("name", "revision", "data_files", "data_dir") if fields.get(k) is not None}
    else:
        for file in [files] if isinstance(files, str) else files:
            if not _is_url(file):
                try:
                    _check_readable(file, builder)
                except DataError as e:
                    raise DataError(f"{label}{e}") from None
        kwargs = {"data_files": {split: files}}
    # Bytes of a text line that are not UTF-8 become U+FFFD instead of stopping the stream; PackedBatches skips
    # and counts such lines.
    if source == LEE_CORPUS:
        kwargs["encoding"] = _LEE_ENCODING
    elif builder == "text":
        kwargs["encoding_errors"] = "replace"
    column = "text" if builder == "text" else src.text_field if src is not None and src.text_field else text_field
    try:
        ds = datasets_library().load_dataset(builder, split=split, streaming=True, **kwargs)
        if column != text_field:
            ds = ds.rename_column(column, text_field)
    except Exception as e:  # noqa: BLE001 - datasets/pyarrow/hub errors rarely name the source
        raise DataError(f"{label}{describe(src or source)}: cannot open the data ({one_line(e, 400)})") from None
    return ds

"""The embedded corpus ``python:docs``: English prose that every Python installation carries, no download.

CPython ships its language reference's topics (``pydoc_data.topics``, the text ``help()`` shows) and thousands of
docstrings in its standard library. Together they are about 1.7 MB of human-written English (roughly 400k tokens of
an 8k byte-level BPE): enough that the demo's few hundred steps see most documents once or twice rather than
memorising a few hundred kilobytes. Code examples (``>>>`` sessions, indented blocks) are dropped, so what remains
is prose. One document per topic or docstring; a fixed 1 in 20 of them (by a hash of the document's name: its
module, object and line, so the split does not depend on the order documents are read in) is the validation split.

:func:`corpus_files` writes both splits once as JSON lines under ``~/.cache/ds_async`` (``DS_ASYNC_CACHE`` to
move it) and returns their paths; ``ds_async.data`` streams them like any local data.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import pydoc_data.topics
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

EMBEDDED_CORPUS = "python:docs"  # the name configs and the tokenizer command give this corpus
SPLITS = ("train", "validation")
MIN_CHARS = 200  # shorter docstrings are mostly one-line summaries
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__"}


def _prose(text: str) -> str:
    """``text`` without its code: interactive sessions and indented blocks (literal blocks in reST)."""
    kept, in_session = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith((">>>", "...")):
            in_session = True
            continue
        if in_session and stripped:  # the output lines of a session
            continue
        in_session = False
        if line.startswith(("    ", "\t")) and not stripped.startswith(("-", "*")):
            continue
        kept.append(line.rstrip())
    paragraphs = [p.strip() for p in "\n".join(kept).split("\n\n")]
    return "\n\n".join(p for p in paragraphs if p)


def documents() -> Iterator[tuple[str, str]]:
    """``(name, text)`` of every document: the reference topics, then the standard library's docstrings."""
    for name, text in sorted(pydoc_data.topics.topics.items()):
        yield f"topic:{name}", _prose(text)
    lib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(lib.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(lib).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        module = ".".join(path.relative_to(lib).with_suffix("").parts)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_CHARS:
                    yield f"{module}:{getattr(node, 'name', '')}:{node.lineno if hasattr(node, 'lineno') else 0}", \
                        _prose(doc)


def split_of(name: str) -> str:
    return "validation" if int(hashlib.sha256(name.encode()).hexdigest(), 16) % 20 == 0 else "train"


def corpus_files(cache: str | os.PathLike | None = None) -> dict[str, Path]:
    """The corpus as ``{split: JSON-lines file}`` (written on first use, atomically)."""
    root = Path(cache or os.environ.get("DS_ASYNC_CACHE") or Path.home() / ".cache" / "ds_async")
    folder = root / f"python-docs-{sys.version_info.major}.{sys.version_info.minor}"
    files = {split: folder / f"{split}.jsonl" for split in SPLITS}
    if all(f.is_file() for f in files.values()):
        return files
    folder.mkdir(parents=True, exist_ok=True)
    tmp = {split: f.with_suffix(f".tmp{os.getpid()}") for split, f in files.items()}
    handles = {split: open(f, "w", encoding="utf-8") for split, f in tmp.items()}
    try:
        for name, text in documents():
            if len(text) >= MIN_CHARS:
                handles[split_of(name)].write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    finally:
        for h in handles.values():
            h.close()
    for split in SPLITS:
        os.replace(tmp[split], files[split])
    return files

"""Reading Hugging Face folders and hub names safely: no remote code, one-line errors.

A local folder whose ``config.json`` or ``tokenizer_config.json`` has ``auto_map`` (a model or tokenizer defined
by code in that folder) is refused before transformers sees it: that code is never run, and transformers would
otherwise stop to ask on stdin, inside a distributed job. Everything else is loaded with
``trust_remote_code=False``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .config import ConfigError


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as ``Type: message`` on one line (Hugging Face's messages span several)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def refuse_remote_code(path: str | os.PathLike, where: str,
                       files: tuple[str, ...] = ("config.json", "tokenizer_config.json")) -> None:
    """Raise ConfigError (``where: ...``) if the local folder ``path`` maps a model or tokenizer to code of its own
    (``auto_map`` in one of ``files``). Such code is never run (everything is loaded with
    ``trust_remote_code=False``), and transformers would otherwise stop to ask on stdin, inside a distributed job.
    A path that is not a local folder (a hub name) is left to the loader."""
    for name in files:
        file = Path(path) / name
        if not file.is_file():
            continue
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: {file} cannot be read as JSON ({one_line(e)})") from None
        if isinstance(raw, dict) and raw.get("auto_map"):
            raise ConfigError(f"{where}: {name} has auto_map (code in that folder defines it); ds_async never runs "
                              "remote code: use a folder with a plain llama/mixtral config and a tokenizer.json")

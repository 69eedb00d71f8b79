"""Reading Hugging Face folders and hub names safely: no remote code, one-line errors, no long wait for a hub that
cannot be reached (:func:`unreachable`).

A local folder whose ``config.json`` or ``tokenizer_config.json`` has ``auto_map`` (a model or tokenizer defined
by code in that folder) is refused before transformers sees it: that code is never run, and transformers would
otherwise stop to ask on stdin, inside a distributed job. Everything else is loaded with
``trust_remote_code=False``.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

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


def unreachable(timeout: float = 5.0) -> str | None:
    """Why the hub (``HF_ENDPOINT``) cannot be reached, or None if a connection opens (or the hub is off,
    ``HF_HUB_OFFLINE``, so nothing will be asked of it). datasets retries an unreachable hub with growing pauses for
    half a minute before it gives up; one connection attempt tells the same at once."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        return f"{url.hostname}:{port}: {e.strerror or type(e).__name__}"
    return None

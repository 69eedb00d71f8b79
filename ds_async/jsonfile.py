"""Plain JSON for the files ds_async writes (run manifests, checkpoint manifests, state identities).

A value that JSON cannot hold as itself is refused when written, naming where it sits, instead of being turned into
a string that reads back as something else (a numpy integer written as ``"3"`` no longer equals the ``3`` a later run
compares it with). Producers convert on purpose at the source (``int(...)``, ``str(path)``); :func:`dumps` is
``json.dumps`` that checks first. Tuples are JSON arrays, as ``json`` writes them; NaN and infinities are written as
``json`` writes them (a diverged run's losses are data).
"""
from __future__ import annotations

import json

_SCALARS = (str, int, float, bool, type(None))


def check(value, where: str = "$") -> None:
    """Raise TypeError naming the first value under ``value`` that is not plain JSON (``where`` is its path)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: key {key!r} ({type(key).__name__}) is not a JSON string")
            check(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check(item, f"{where}[{i}]")
    elif type(value) not in _SCALARS:
        # Subclasses too (numpy.float64, an IntEnum, a str enum): json writes them by their class's whims, so only
        # the builtin types are written as themselves.
        raise TypeError(f"{where}: {value!r} ({type(value).__module__}.{type(value).__name__}) is not plain JSON; "
                        "convert it where it is produced")


def dumps(value, **kwargs) -> str:
    """``json.dumps(value, **kwargs)`` of a value that :func:`check` accepts (TypeError naming the path if not)."""
    check(value)
    return json.dumps(value, **kwargs)

"""Run a test file's checks under Triton's CPU interpreter: in a child process (``python FILE``), since Triton reads
``TRITON_INTERPRET`` when it is imported; the file's ``__main__`` prints one ``ok ...`` line per check passed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_interpreted(path: str, checks: int) -> None:
    """Runs ``python path`` with the interpreter on and asserts that it ended well with ``checks`` lines ``ok``."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("ok") == checks, proc.stdout

"""The checkpoint folder protocol: atomic, verified, pruned. Knows nothing about engines or models.

A checkpoint is one folder ``<root>/step_00000123`` (after 123 optimizer steps) whose ``checkpoint.json``, written
last, lists every file with its size and the sha256 of each of its 16 MiB blocks (blocks, so that many threads hash
one large file; format 1, still read, had one sha256 a file). Its presence in a folder without the ``.tmp`` suffix is
what makes a checkpoint complete.

Writing (:func:`write`): every rank writes its files into ``step_N.tmp/`` and hashes them; rank 0 gathers the files'
sizes and hashes, writes the manifest, and renames the folder to ``step_N/`` (``os.replace``, atomic on a POSIX
filesystem), then prunes all but the newest ``keep``. A save killed at any point leaves at most a ``.tmp`` folder
that nothing reads (the next save removes it), so the previous checkpoint stays the newest complete one.

A step folder without a manifest (not written by this protocol) is never read, and a save
of that step moves it aside as ``step_N.incomplete-<time>`` with a warning instead of failing on it.

In the background (:class:`BackgroundWriter`): the same write on a thread of its own, one at a time, with its
collectives over a process group only it uses, while the caller goes on.

One job at a time: :func:`lock` takes an advisory lock (``fcntl.flock`` on ``<root>/.lock``, which records the
holder's pid and host) for the life of the process; the OS drops it when the process ends, however it ends. The
lock file and the start's probe file are opened without following symbolic links: a ``.lock`` that is a link (or
anything but a regular file) is refused, so that a planted link cannot make the job write over its target.

Disk space: a save that finds less free space than its files need (estimated from the tensors each rank writes),
or that fails writing for want of space, stops with one line naming the folder, the free space and the need; the
previous checkpoints stay intact and the half-written folder is removed.

Reading: :func:`verify` checks the sizes and hashes of the files a rank reads against the manifest, and
:func:`load_file` loads ``.pt`` files with ``torch.load(weights_only=True)``; a missing, truncated or corrupt file
is refused with its path. :func:`verifying` does the hashing on threads while its block loads the files, and refuses
them at its end, before the caller applies anything it loaded.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as tdist

from .. import jsonfile

FORMAT = 2
READABLE = (1, 2)  # manifest formats this version reads: 1 hashed each file whole
BLOCK = 16 << 20  # bytes a block hash covers
MANIFEST = "checkpoint.json"
LOCK = ".lock"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as asked; the message names the path."""


# ------------------------------------------------------------------------------------------------ collectives
def world_rank_size(group) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size (``None``: the whole world; no process group: 0, 1)."""
    if not tdist.is_available() or not tdist.is_initialized():
        return 0, 1
    return tdist.get_rank(group), tdist.get_world_size(group)


def gather(obj, group) -> list:
    """Every rank's ``obj`` in ``group``, in the group's rank order (single process: ``[obj]``)."""
    rank, world = world_rank_size(group)
    if world == 1:
        return [obj]
    out = [None] * world
    tdist.all_gather_object(out, obj, group=group)
    return out


def raise_if_any(error: str | None, group) -> None:
    """Raise the first rank's error on every rank, so that no rank waits in a collective for a failed one."""
    errors = [e for e in gather(error, group) if e]
    if errors:
        raise CheckpointError(errors[0])


def agree(value, group):
    """Rank 0's ``value`` (an object, or the exception it raised) on every rank."""
    box = [value]
    tdist.broadcast_object_list(box, src=0, group=group)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


# ------------------------------------------------------------------------------------------------ the folder
def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the complete checkpoints under ``root``, oldest first (``.tmp`` folders and folders
    without a manifest are partial and left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / MANIFEST).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve(spec: str | os.PathLike) -> Path | None:
    """A checkpoint folder from ``spec``: a checkpoint folder itself, or a folder of them (its newest complete
    one; None if it has none)."""
    path = Path(spec)
    if (path / MANIFEST).is_file():
        return path
    if path.name.endswith(".tmp") and _STEP_DIR.match(path.name[:-4]):
        raise CheckpointError(f"{path}: an incomplete checkpoint (its save was interrupted); use a complete one")
    if _STEP_DIR.match(path.name) and path.is_dir():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {MANIFEST})")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint folder")
    return latest(path)


def prepare(root: str | os.PathLike) -> Path:
    """Create checkpoint folder ``root`` if needed and check that files can be written and removed in it (a probe
    file); raises OSError otherwise. For a job's start, so that an unusable folder is found before training."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f".probe-{socket.gethostname()}-{os.getpid()}"
    if os.path.islink(probe):  # a link planted under this name: the probe must not write through it
        probe.unlink()
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, b"ds_async")
        os.fsync(fd)
    finally:
        os.close(fd)
    probe.unlink()
    return root


_held: dict[str, int] = {}  # real path of a checkpoint folder -> the descriptor of its lock file, in this process


def lock(root: str | os.PathLike) -> None:
    """Hold checkpoint folder ``root`` for this process: an exclusive ``fcntl.flock`` on ``root/.lock``, kept until
    the process ends (the OS releases it however the process ends, so a killed job leaves no stale lock) or
    :func:`release`. Raises CheckpointError naming the folder and the holder (pid, host, since when) if another
    process holds it. Taking a lock this process already holds does nothing (one job's trainer runs, one after
    the other). On a filesystem without ``flock`` it warns and goes on unlocked."""
    root = Path(root)
    key = os.path.realpath(root)
    if key in _held:
        return
    if os.path.islink(root / LOCK):
        raise CheckpointError(f"{root / LOCK}: a symbolic link (to {os.readlink(root / LOCK)}), not a lock file; "
                              "ds_async does not follow it (the job would write over its target): remove it")
    try:
        # O_NOFOLLOW: a link planted between the check above and this open fails here (ELOOP) instead of being
        # followed.
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:  # e.g. a shared folder whose lock file another user created
        raise CheckpointError(f"{root / LOCK}: cannot open the checkpoint folder's lock file ({e.strerror or e}); "
                              "give this job a folder it can write (ds_async.checkpoint.dir)") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device node where the lock file belongs
        os.close(fd)
        raise CheckpointError(f"{root / LOCK}: not a regular file; a checkpoint folder's lock file must be one: "
                              "remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            who = f"pid {holder['pid']} on host {holder['host']}, since {holder['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            who = "holder unknown"
        os.close(fd)
        raise CheckpointError(f"{root}: in use by another job ({who}), which holds {root / LOCK}; two jobs on one "
                              "checkpoint folder would delete each other's saves. Wait for it to end (or stop it), "
                              "or give this job another run name or ds_async.checkpoint.dir") from None
    except OSError as e:
        os.close(fd)
        print(f"ds_async: warning: {root / LOCK}: cannot lock ({e.strerror or e}); this filesystem does not support "
              "flock, so nothing stops a second job from using the same checkpoint folder", flush=True)
        return
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, info, 0)
    _held[key] = fd


def release(root: str | os.PathLike) -> None:
    """Give up this process's lock on ``root`` (if it holds one)."""
    fd = _held.pop(os.path.realpath(root), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor of the open file releases the flock


def discard_if_unused(root: str | os.PathLike) -> bool:
    """Remove checkpoint folder ``root`` if this process holds its lock (:func:`lock`: the folder is this job's) and
    it holds nothing but that lock (a job that stopped before its first save), releasing the lock; returns whether
    it did. A folder another job holds, or one with anything else in it, is left as it is."""
    root = Path(root)
    if os.path.realpath(root) not in _held:
        return False
    try:
        if {p.name for p in root.iterdir()} - {LOCK}:
            return False
        release(root)
        (root / LOCK).unlink(missing_ok=True)
        root.rmdir()
    except OSError:  # gone already, or another job's files appeared in it: leave it
        return False
    return True


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the checkpoint folder ``path``; CheckpointError naming the file if it is not readable."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a complete checkpoint (no {MANIFEST})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable checkpoint manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE or not isinstance(
            manifest.get("files"), dict):
        raise CheckpointError(f"{file}: not a ds_async checkpoint manifest of a format this version reads "
                              f"({', '.join(map(str, READABLE))})")
    return manifest


def sha256(path: str | os.PathLike) -> str:
    """The sha256 of the whole file (format 1's hash)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _block_sha256(path: Path, offset: int, length: int) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    if len(data) != length:
        raise CheckpointError(f"{path}: shorter than its size while being read (changed by another process?)")
    return hashlib.sha256(data).hexdigest()


def _hash_pool() -> ThreadPoolExecutor:
    """Threads for hashing: hashlib and file reads release the GIL, so they run in parallel with each other and with
    the caller's loading. Up to 8, within this process's CPUs (the ranks of a node share them)."""
    return ThreadPoolExecutor(max(1, min(8, len(os.sched_getaffinity(0)))), thread_name_prefix="ds_async-hash")


def _block_hashes(pool: ThreadPoolExecutor, path: Path, size: int, block: int = BLOCK) -> list[Future]:
    return [pool.submit(_block_sha256, path, at, min(block, size - at)) for at in range(0, size, block)]


def describe(folder: Path, names) -> dict:
    """The manifest entries of files ``names`` in ``folder``: size, block size and each block's sha256."""
    sizes = {n: (folder / n).stat().st_size for n in names}
    with _hash_pool() as pool:
        hashes = {n: _block_hashes(pool, folder / n, sizes[n]) for n in names}
        return {n: {"size": sizes[n], "block_size": BLOCK, "block_sha256": [f.result() for f in hashes[n]]}
                for n in names}


@contextmanager
def verifying(path: str | os.PathLike, names, manifest: dict | None = None):
    """Check files of checkpoint ``path`` against its manifest while the ``with`` block runs (it loads them): sizes
    at once, hashes on threads, waited for at the block's end. CheckpointError naming the first bad file, raised at
    the start (missing, wrong size) or the end (contents), also in place of an error the block raised on a corrupt
    file, so that nothing loaded is used before its file is known to be intact."""
    path = Path(path)
    manifest = manifest or read_manifest(path)
    checks = [(path / name, _expected(path / name, manifest["files"].get(name))) for name in names]
    pool = _hash_pool()
    try:
        pending = [(file, want["block_sha256"], _block_hashes(pool, file, want["size"], want["block_size"]))
                   if "block_sha256" in want else (file, [want["sha256"]], [pool.submit(sha256, file)])
                   for file, want in checks]
        try:
            yield
        finally:
            for file, want, hashes in pending:
                try:
                    got = [f.result() for f in hashes]
                except OSError as e:
                    raise CheckpointError(f"{file}: cannot be read ({e.strerror or e})") from None
                if got != want:
                    raise CheckpointError(f"{file}: contents do not match the manifest's sha256 (corrupt); "
                                          "refusing this checkpoint")
    finally:
        pool.shutdown(cancel_futures=True)


def _expected(file: Path, want) -> dict:
    """The manifest entry ``want`` of ``file``, once the file is there with the size it gives."""
    if want is None:
        raise CheckpointError(f"{file}: not listed in the checkpoint's manifest")
    if not isinstance(want, dict) or not isinstance(want.get("size"), int) or not (
            "sha256" in want or isinstance(want.get("block_size"), int) and want["block_size"] > 0
            and isinstance(want.get("block_sha256"), list)):
        raise CheckpointError(f"{file}: its manifest entry has no size and hash")
    try:
        size = file.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{file}: missing from the checkpoint ({e.strerror})") from None
    if size != want["size"]:
        raise CheckpointError(f"{file}: {size} bytes, the manifest says {want['size']} (truncated or "
                              "overwritten); refusing this checkpoint")
    return want


def verify(path: str | os.PathLike, names, manifest: dict | None = None) -> None:
    """Check files of checkpoint ``path`` against its manifest (size, then sha256); CheckpointError naming the
    first bad file."""
    with verifying(path, names, manifest):
        pass


def load_file(file: str | os.PathLike, map_location="cpu"):
    """``torch.load(file, weights_only=True)``; any failure becomes a CheckpointError naming the file."""
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise CheckpointError(f"{file}: cannot be loaded ({type(e).__name__}: {e})") from None


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_torch(obj, file: Path) -> None:
    torch.save(obj, file)
    fsync(file)


def write(root: str | os.PathLike, step: int, write_files, manifest: dict, keep: int = 0, group=None,
          write_index=None, need: int = 0) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically, collectively over the ranks of ``group`` (``None``:
    all ranks; rank 0 below is the group's first).

    ``write_files(tmp_dir) -> list[str]`` writes this rank's files into the temporary folder and returns their
    names; ``write_index(tmp_dir) -> list[str]`` runs on rank 0 once every rank's files exist (to index them).
    Rank 0 then writes the manifest (``manifest`` plus step and file list), renames the folder into place and
    prunes to the newest ``keep`` (0: keep all). Returns the final folder.

    ``need``: about how many bytes this rank writes. With less free space than all ranks need together, nothing is
    written; a write that fails while the disk is full is reported as that (:func:`disk_full`), not as the
    writer's error. Either way the temporary folder is removed and the earlier checkpoints stay as they were.
    """
    root = Path(root)
    rank, world = world_rank_size(group)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    total = sum(gather(need, group))
    raise_if_any(_prepare(root, tmp, final, total) if rank == 0 else None, group)
    space = _Space(root, final, free_bytes(root), total)
    files, error = space.written(write_files, tmp, rank, need)
    gathered = gather((files, error), group)
    errors = [e for _, e in gathered if e]
    if rank == 0 and not errors:
        errors = _complete(space, tmp, step, manifest, keep, {k: v for f, _ in gathered for k, v in f.items()},
                           write_index, need)
    if rank == 0 and errors:
        shutil.rmtree(tmp, ignore_errors=True)  # frees what the failed save took; nothing reads a .tmp folder
    raise_if_any(errors[0] if errors else None, group)
    return final


class BackgroundWriter:
    """Checkpoint writes (:func:`write`) on a thread of their own, one at a time, while the caller goes on.

    ``group``: a process group of all the writing ranks that only this writer uses (the caller's collectives on its
    own groups would otherwise interleave with the write's). :meth:`submit` first waits for the write in flight;
    :meth:`wait` returns its folder or raises its error, which :func:`write` agrees on over the group, so every rank
    raises alike. The thread is a daemon: a process that fails without waiting leaves at most a ``.tmp`` folder,
    which nothing reads and the next save removes."""

    def __init__(self, group):
        self.group = group
        self._pending: Future | None = None

    def submit(self, write_with) -> None:
        """Run ``write_with(group) -> Path`` on the writer's thread, once the write before it has ended."""
        self.wait()
        future = Future()

        def run():
            try:
                future.set_result(write_with(self.group))
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread by wait()
                future.set_exception(e)

        threading.Thread(target=run, name="ds_async-checkpoint-writer", daemon=True).start()
        self._pending = future

    def wait(self) -> Path | None:
        """The folder of the write in flight once it is complete (None if none is); its error if it failed."""
        future, self._pending = self._pending, None
        return None if future is None else future.result()


def _prepare(root: Path, tmp: Path, final: Path, total: int) -> str | None:
    """On the writing group's first rank: the root and an empty temporary folder, if the filesystem has room for
    ``total`` bytes; the error line otherwise."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save of the same step that was killed earlier
    except OSError as e:
        return f"{tmp}: cannot create the checkpoint folder ({e})"
    free = free_bytes(root)
    if free is not None and free < total:
        return disk_full(root, free, total, final)
    try:
        tmp.mkdir()
    except OSError as e:
        return disk_full(root, free, total, final) if _no_space(e) else \
            f"{tmp}: cannot create the checkpoint folder ({e})"
    return None


class _Space:
    """Where a save writes and how much room it had at the start, to report a write that fails on a full disk as
    that (:func:`disk_full`) rather than as the writer's error."""

    def __init__(self, root: Path, final: Path, free_at_start: int | None, total: int):
        self.root, self.final, self.free_at_start, self.total = root, final, free_at_start, total

    def written(self, fn, tmp: Path, rank: int, need: int) -> tuple[dict, str | None]:
        """``fn(tmp)``'s files described, or its error line (on every rank: the caller gathers them)."""
        try:
            names = fn(tmp)
            return describe(tmp, names), None
        except Exception as e:  # noqa: BLE001 - reported on every rank by the caller
            free = free_bytes(self.root)
            if _no_space(e) or free is not None and free < max(need, 1 << 20):
                return {}, self.full()
            return {}, f"{tmp}: rank {rank} failed to write its files ({type(e).__name__}: {e})"

    def full(self) -> str:
        return disk_full(self.root, self.free_at_start, self.total, self.final)


def _complete(space: _Space, tmp: Path, step: int, manifest: dict, keep: int, files: dict, write_index,
              need: int) -> list[str]:
    """On the first rank once every rank's files exist: the index, the manifest, the rename into place and the
    pruning; the errors (empty when the checkpoint is complete)."""
    if write_index is not None:
        more, error = space.written(write_index, tmp, 0, need)
        if error:
            return [error]
        files.update(more)
    try:
        _finish(space.root, tmp, space.final, step, {**manifest, "files": dict(sorted(files.items()))}, keep)
    except OSError as e:
        return [space.full() if _no_space(e) else f"{space.final}: cannot complete the checkpoint ({e})"]
    return []


def free_bytes(folder: Path) -> int | None:
    """Bytes free for this process in ``folder``'s filesystem (None if it cannot be asked)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _no_space(e: BaseException) -> bool:
    """Whether ``e`` (or an error it was raised from) is the OS's "no space left" or "quota exceeded"."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def disk_full(root: Path, free: int | None, need: int, final: Path) -> str:
    """The one line for a save that does not fit: the folder, its free space and what the checkpoint needs."""
    mib = 1 << 20
    have = "free space unknown" if free is None else f"{free / mib:.1f} MiB free"
    return (f"{root}: the disk is full ({have}, the checkpoint needs about {need / mib:.1f} MiB); {final.name} was "
            "not saved and the checkpoints before it are intact: free space there, lower ds_async.checkpoint.keep, "
            "or point ds_async.checkpoint.dir at a larger disk")


def _finish(root: Path, tmp: Path, final: Path, step: int, manifest: dict, keep: int) -> None:
    body = jsonfile.dumps({"format": FORMAT, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           **manifest}, indent=1)
    part = tmp / (MANIFEST + ".part")
    part.write_text(body)
    fsync(part)
    os.replace(part, tmp / MANIFEST)
    fsync(tmp)
    # Checkpoints newer than this one belong to a run that was abandoned (this one resumed from an older
    # checkpoint): move them aside, so that a later --resume continues this run and not that one.
    for other_step, other in complete_checkpoints(root):
        if other_step >= step:
            other.rename(_aside(other, "superseded"))
    if os.path.lexists(final):  # a step folder without a manifest: nothing reads it, and it would block the rename
        aside = _aside(final, "incomplete")
        final.rename(aside)
        print(f"ds_async: warning: {final} had no {MANIFEST} (an incomplete checkpoint, not written by a finished "
              f"save); moved it aside to {aside.name} and saved step {step} in its place", flush=True)
    os.replace(tmp, final)
    fsync(root)
    _prune(root, keep)


def _aside(folder: Path, why: str) -> Path:
    """A free name ``<folder>.<why>-<time>`` next to ``folder``."""
    base = f"{folder.name}.{why}-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, n = folder.with_name(base), 1
    while os.path.lexists(aside):
        aside, n = folder.with_name(f"{base}-{n}"), n + 1
    return aside


def _prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop leftovers of interrupted saves and prunes."""
    for child in root.iterdir():
        name = child.name
        if child.is_dir() and (name.endswith(".tmp") or name.endswith(".deleting")) and name.startswith("step_"):
            shutil.rmtree(child, ignore_errors=True)
    if keep <= 0:
        return
    for _, folder in complete_checkpoints(root)[:-keep]:
        # Renamed first, so that a prune killed half-way never leaves a half-deleted folder that looks complete.
        doomed = folder.with_name(folder.name + ".deleting")
        folder.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)

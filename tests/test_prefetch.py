"""``ds_async.prefetch.Prefetcher``: the steps it hands out are the streams' micro-batches in order, read in the
caller's thread or a background reader alike, and its position resumes mid-chunk."""
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_async.config import DataConfig
from ds_async.data import LEE_CORPUS, load_tokenizer, open_replica_streams
from ds_async.prefetch import MicroBatchReader, Prefetcher, ReaderProcess


class Counting:
    """A micro-batch stream with a position: micro-batch ``k`` is filled with ``base + k``."""

    def __init__(self, base: int):
        self.base, self.k = base, 0

    def __next__(self):
        x = torch.full((2, 3), self.base + self.k, dtype=torch.long)
        self.k += 1
        return x, x + 1

    def state_dict(self):
        return {"k": self.k}

    def load_state_dict(self, state):
        self.k = state["k"]


def values(step):
    return [int(x[0, 0]) for x, _ in step]


def test_steps_in_stream_order_with_or_without_the_reader():
    for background in (False, True):
        p = Prefetcher([Counting(0), Counting(100)], per_step=2, device=torch.device("cpu"), steps=5, chunk=2,
                       background=background)
        got = [values(p.next_step()) for _ in range(5)]
        p.close()
        assert got == [[2 * i, 2 * i + 1, 100 + 2 * i, 101 + 2 * i] for i in range(5)], background


def test_resume_mid_chunk_reads_the_next_steps_and_nothing_past_the_last():
    p = Prefetcher([Counting(0)], per_step=1, device=torch.device("cpu"), steps=7, chunk=3)
    first = [values(p.next_step()) for _ in range(4)]  # the second chunk is one step in
    state = p.state_dict()
    assert state == {"streams": [{"k": 3}], "skip": 1}
    stream = Counting(0)
    q = Prefetcher([stream], per_step=1, device=torch.device("cpu"), steps=3, chunk=3)
    q.load_state_dict(state)
    rest = [values(q.next_step()) for _ in range(3)]
    assert first + rest == [[k] for k in range(7)] and stream.k == 7
    # Built for the whole run, as a resumed run's is before it knows where it resumes: told the steps left there.
    stream = Counting(0)
    whole = Prefetcher([stream], per_step=1, device=torch.device("cpu"), steps=7, chunk=3)
    whole.load_state_dict(state, steps=3)
    assert [values(whole.next_step()) for _ in range(3)] == rest and stream.k == 7


CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"


def lee_streams(replicas: int = 2, train: str = LEE_CORPUS):
    """The emulation's training streams (``data.open_replica_streams``) over the Lee corpus, as a picklable
    function: what a reader process opens."""
    tokenizer_file = CORPUS / "tokenizers" / "bpe8192.json"
    if not tokenizer_file.is_file():
        pytest.skip(f"shared corpus not found at {CORPUS} (the repo must be cloned next to shared/)")
    cfg = DataConfig(train=train, seq_len=16, shuffle_buffer=8)
    return functools.partial(open_replica_streams, cfg, load_tokenizer(str(tokenizer_file)), 2, replicas, 3, 4)


def taken(prefetcher, n):
    return [[(x.clone(), y.clone()) for x, y in prefetcher.next_step()] for _ in range(n)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(len(s) == len(t) and all(torch.equal(x, u) and torch.equal(y, v)
                                                           for (x, y), (u, v) in zip(s, t)) for s, t in zip(a, b))


def test_a_reader_process_reads_what_the_caller_would_and_resumes_mid_chunk():
    """Real streams (tokenized text, a shuffle buffer, two replicas) read in a reader process give the steps, the
    position and the skipped-document counts of reading them in place; a reader started from a mid-chunk position
    gives the rest."""
    streams = lee_streams()
    inline = Prefetcher(streams, per_step=2, device=torch.device("cpu"), steps=9, chunk=4, background=False)
    want = taken(inline, 9)
    process = Prefetcher(streams, per_step=2, device=torch.device("cpu"), steps=9, chunk=4, background=True)
    try:
        first = taken(process, 6)  # the second chunk is two steps in
        state = process.state_dict()
        skipped = process.skipped
    finally:
        process.close()
    assert same(first, want[:6]) and state["skip"] == 2 and len(state["streams"]) == 2
    again = Prefetcher(streams, per_step=2, device=torch.device("cpu"), steps=9, chunk=4, background=False)
    taken(again, 6)
    assert again.state_dict() == state and again.skipped == skipped

    resumed = Prefetcher(streams, per_step=2, device=torch.device("cpu"), steps=3, chunk=4, background=True)
    resumed.load_state_dict(state)
    try:
        assert same(taken(resumed, 3), want[6:])
    finally:
        resumed.close()


def test_a_reader_process_started_before_its_streams_reads_the_same_steps():
    """A :class:`ReaderProcess` spawned first (importing while the caller builds the model) and given its streams
    later reads the steps of reading in place, from the start and from a mid-chunk position; one never given work
    ends when closed."""
    streams = lee_streams()
    inline = Prefetcher(streams, per_step=2, device=torch.device("cpu"), steps=9, chunk=4, background=False)
    want = taken(inline, 9)
    early = ReaderProcess(imports=("ds_async.data",))
    process = Prefetcher(streams, per_step=2, device=torch.device("cpu"), steps=9, chunk=4, background=True,
                         reader=early)
    try:
        assert same(taken(process, 6), want[:6])
        state = process.state_dict()
    finally:
        process.close()
    assert not early.process.is_alive()
    resumed = Prefetcher(streams, per_step=2, device=torch.device("cpu"), steps=3, chunk=4, background=True,
                         reader=ReaderProcess(imports=("ds_async.data",)))
    resumed.load_state_dict(state)
    try:
        assert same(taken(resumed, 3), want[6:])
    finally:
        resumed.close()
    unused = ReaderProcess()
    assert unused.ready.wait(timeout=300)  # past its imports (seconds on a loaded machine), as a real one would be
    unused.close()
    assert unused.process.exitcode == 0


def test_a_reader_process_closed_while_it_imports_is_ended_at_once():
    """A reader closed before its imports are done (its job failed at start, or its rank turned out not to read) is
    terminated then, not waited for: it would see the stop only once its imports (seconds) are over."""
    reader = ReaderProcess(imports=("ds_async.data",))
    reader.close()
    assert not reader.process.is_alive() and reader.process.exitcode == -signal.SIGTERM


READER_FROM_A_SCRIPT = """
import os, sys, time
with open(os.environ["MARKER"], "a") as f:  # every process that runs this file's top level leaves its pid
    f.write(f"{os.getpid()}\\n")
if __name__ == "__main__":
    from ds_async.prefetch import ReaderProcess
    here, spec = __file__, __spec__
    reader = ReaderProcess(imports=("ready_probe",))
    assert (__file__, __spec__) == (here, spec)
    deadline = time.monotonic() + 300  # the reader's imports (torch) on a loaded machine
    while "ready" not in open(os.environ["MARKER"]).read() and time.monotonic() < deadline:
        time.sleep(0.05)
    reader.close()
    assert reader.process.exitcode == 0, reader.process.exitcode
"""
READY_PROBE = """
import os
with open(os.environ["MARKER"], "a") as f:  # the reader has run its imports: it waits for work now
    f.write("ready\\n")
"""


def test_a_reader_process_does_not_run_the_parent_script(tmp_path):
    """A training script's top level (its imports: the parent's whole start-up) does not run again in the reader
    process, as a spawned child's import of ``__main__`` would run it before the reader's own imports; the script's
    ``__file__`` and ``__spec__`` are as before once the reader has started, and the reader ends when closed."""
    script, marker = tmp_path / "train_like.py", tmp_path / "pids"
    script.write_text(READER_FROM_A_SCRIPT)
    (tmp_path / "ready_probe.py").write_text(READY_PROBE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MARKER": str(marker)})
    assert done.returncode == 0, done.stderr
    lines = marker.read_text().split()
    assert len(lines) == 2 and lines[1] == "ready", lines  # the script's own pid, then the reader's imports


def test_a_reader_process_hands_its_error_to_the_caller(tmp_path):
    missing = str(tmp_path / "none-*.parquet")
    with pytest.raises(FileNotFoundError, match="none-"):
        Prefetcher(lee_streams(train=missing), per_step=1, device=torch.device("cpu"), steps=2, background=False)
    process = Prefetcher(lee_streams(train=missing), per_step=1, device=torch.device("cpu"), steps=2,
                         background=True)
    try:
        with pytest.raises(FileNotFoundError, match="none-"):
            process.next_step()
    finally:
        process.close()


def test_a_reader_refuses_a_step_past_the_last_as_reading_in_place_does():
    for background in (False, True):
        p = Prefetcher([Counting(0)], per_step=1, device=torch.device("cpu"), steps=2, chunk=2, background=background)
        try:
            assert [values(p.next_step()) for _ in range(2)] == [[0], [1]]
            with pytest.raises(RuntimeError, match="every step it was built for has been taken"):
                p.next_step()
        finally:
            p.close()


def test_micro_batch_reader_resumes_exactly_in_either_reader():
    """The engine's reader (``MicroBatchReader``) hands out the stream's micro-batches in order, read here or in a
    reader process a chunk at a time, and a position saved by either, mid-chunk, resumes in either."""
    cpu = torch.device("cpu")
    opener = functools.partial(Counting, 0)
    for saved_by in (False, True):
        for resumed_by in (False, True):
            reader = MicroBatchReader(Counting(0), opener, cpu, chunk=3, background=saved_by)
            reader.start()
            first = [int(next(reader)[0][0, 0]) for _ in range(4)]
            state = reader.state_dict()
            reader.close()
            assert state == {"k": 3, "skip": 1}, state  # chunk start and micro-batches taken since
            again = MicroBatchReader(Counting(0), opener, cpu, chunk=3, background=resumed_by)
            again.load_state_dict(state)
            rest = [int(next(again)[0][0, 0]) for _ in range(3)]
            again.close()
            assert first + rest == list(range(7)), (saved_by, resumed_by)


def test_a_reader_begun_at_the_streams_start_reads_and_resumes_as_one_handed_its_position():
    """A fresh run's set-up sets its reader process reading at the stream's start before the model builds
    (``MicroBatchReader.begin_at``), before the MicroBatchReader exists: that reader hands out the micro-batches
    of one handed the position at its start, and its positions, before its first micro-batch and mid-chunk, resume
    exactly. A reader reading from the start refuses a position given to the MicroBatchReader."""
    cpu = torch.device("cpu")
    opener = functools.partial(Counting, 0)
    reader = ReaderProcess()
    MicroBatchReader.begin_at(reader, opener, 3)
    early = MicroBatchReader(Counting(0), opener, cpu, chunk=3, background=True, reader=reader)
    try:
        early.start()
        at_start = early.state_dict()
        first = [int(next(early)[0][0, 0]) for _ in range(4)]
        mid = early.state_dict()
    finally:
        early.close()
    assert first == [0, 1, 2, 3] and at_start == {"k": 0, "skip": 0} and mid == {"k": 3, "skip": 1}
    for state, taken_before in ((at_start, 0), (mid, 4)):
        again = MicroBatchReader(Counting(0), opener, cpu, chunk=3, background=False)
        again.load_state_dict(state)
        assert [int(next(again)[0][0, 0]) for _ in range(3)] == list(range(taken_before, taken_before + 3))
        again.close()

    begun = ReaderProcess()
    MicroBatchReader.begin_at(begun, opener, 3)
    refused = MicroBatchReader(Counting(0), opener, cpu, chunk=3, background=True, reader=begun)
    refused.load_state_dict(mid)
    try:
        with pytest.raises(RuntimeError, match="reads from the stream's start"):
            next(refused)
    finally:
        refused.close()
    assert not begun.process.is_alive()


def test_a_reader_begun_at_a_saved_position_reads_as_one_handed_it_and_refuses_another():
    """A resumed run's set-up reads its checkpoint's position first and sets its reader process reading there before
    the model builds (``MicroBatchReader.begin_at`` with the position); the restore then gives the MicroBatchReader
    that same position. Mid-chunk (the chunk's start plus the micro-batches used of it) and at a chunk's start, it
    hands out what a reader handed the position at start does, and its positions resume exactly. Given another
    position, or none, it refuses to read: it would hand out the wrong micro-batches."""
    cpu = torch.device("cpu")
    opener = functools.partial(Counting, 0)
    for position, taken_before in (({"k": 3, "skip": 1}, 4), ({"k": 6, "skip": 0}, 6)):
        reader = ReaderProcess()
        MicroBatchReader.begin_at(reader, opener, 3, position)
        early = MicroBatchReader(Counting(0), opener, cpu, chunk=3, background=True, reader=reader)
        early.load_state_dict(position)
        try:
            early.start()
            assert early.state_dict() == position
            got = [int(next(early)[0][0, 0]) for _ in range(4)]
            mid = early.state_dict()
        finally:
            early.close()
        assert got == list(range(taken_before, taken_before + 4))
        again = MicroBatchReader(Counting(0), opener, cpu, chunk=3, background=False)
        again.load_state_dict(mid)
        assert [int(next(again)[0][0, 0]) for _ in range(2)] == [taken_before + 4, taken_before + 5]
        again.close()

    for given, refusal in (({"k": 3, "skip": 2}, None), ({"k": 0, "skip": 0}, "another position"),
                           (None, "a position this reader was not given")):
        begun = ReaderProcess()
        MicroBatchReader.begin_at(begun, opener, 3, {"k": 3, "skip": 1})
        reader = MicroBatchReader(Counting(0), opener, cpu, chunk=3, background=True, reader=begun)
        if given is not None:
            reader.load_state_dict(given)
        try:
            if refusal is None:  # the same chunk, another count used of it: what the restore may hand over
                assert int(next(reader)[0][0, 0]) == 5
            else:
                with pytest.raises(RuntimeError, match=refusal):
                    next(reader)
        finally:
            reader.close()
        assert not begun.process.is_alive()

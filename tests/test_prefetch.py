"""``ds_async.prefetch.Prefetcher``: the steps it hands out are the streams' micro-batches in order, read in the
caller's thread or a background one alike, and its position resumes mid-chunk."""
import torch

from ds_async.prefetch import Prefetcher


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


def test_steps_in_stream_order_with_or_without_the_thread():
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

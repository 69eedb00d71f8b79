"""``runs.time_to_loss``: when a validation curve first reaches a target loss, by hand."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("runs_ttl", ROOT / "notebooks" / "runs.py")
runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runs)


def test_first_crossing_interpolated_between_evaluations():
    seconds, losses = [10.0, 20.0, 30.0, 40.0], [5.0, 4.0, 3.0, 2.5]
    assert runs.time_to_loss(seconds, losses, 3.5) == 25.0  # halfway from 4.0 at 20 s to 3.0 at 30 s
    assert runs.time_to_loss(seconds, losses, 3.0) == 30.0
    assert runs.time_to_loss(seconds, losses, 6.0) == 10.0  # reached at the first evaluation
    assert runs.time_to_loss(seconds, losses, 2.0) is None


def test_a_later_rise_does_not_undo_the_first_crossing():
    assert runs.time_to_loss([1.0, 2.0, 3.0], [4.0, 2.0, 5.0], 3.0) == 1.5

"""The one home of rich progress bars (train/loop/progress.py): what its factories build."""

from rich.progress import SpinnerColumn, TimeElapsedColumn

from torchspeed.train.loop.progress import progress_bar, status_bar, track


def test_the_bar_is_silent_when_disabled_and_transient_by_default():
    assert progress_bar(enabled=False).disable and not progress_bar().disable
    assert progress_bar().live.transient and not progress_bar(transient=False).live.transient


def test_the_status_bar_is_a_transient_spinner_with_the_time_elapsed():
    bar = status_bar("doctor: running")
    assert [type(c) for c in bar.columns][::2] == [SpinnerColumn, TimeElapsedColumn] and bar.live.transient


def test_track_yields_every_item_with_or_without_a_bar():
    assert list(track(iter(range(5)), description="x", enabled=False)) == list(range(5))
    assert list(track(range(3), description="counting", total=3)) == [0, 1, 2]

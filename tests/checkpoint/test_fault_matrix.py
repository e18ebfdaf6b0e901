"""A short run of the fault matrix (tests/fixtures/faults/matrix.py): kill -9 at three points of a
checkpoint save, each resumed to the uninterrupted run's losses bitwise. The full matrix (20
kills, a real full disk, a corrupt newest checkpoint) is `python -m tests.fixtures.faults.matrix`; its
counts are in docs/reliability.md."""

import pytest

from tests.fixtures.faults import matrix


@pytest.mark.slow
def test_kills_during_a_save_resume_exactly():
    trials = matrix.main(["--kills", "3", "--skip-disk", "--skip-corrupt"])
    assert len(trials) == 3
    assert all(t.survived for t in trials), [(t.detail, t.why) for t in trials if not t.survived]


@pytest.mark.slow
def test_kills_during_an_async_save_resume_exactly():
    """The same with checkpoint.async_mode = "async" (two kills, other points of the save): all but
    the first operation of the save (its stale-folder removal, in the step) run in the background
    writer and finaliser while the next step trains. Each killed run leaves no process behind, and
    resumes to the synchronous run's losses."""
    trials = matrix.main(["--kills", "2", "--seed", "1", "--skip-disk", "--skip-corrupt", "--async-mode", "async"])
    assert len(trials) == 2 and all(t.case == "kill -9 in a save (async)" for t in trials)
    assert all(t.survived for t in trials), [(t.detail, t.why) for t in trials if not t.survived]

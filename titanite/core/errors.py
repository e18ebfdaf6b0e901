"""Error types. A `UserError` is something the user can fix (config, input files, layout).

The command-line entry points turn it into one clear message and exit code 2; anything else
that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3


class UserError(ValueError):
    """Bad input: the message names the key, file, tensor or layout that is wrong."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN or Inf. The last good checkpoint is kept; nothing is saved after."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A ' (did you mean 'x'?)' suffix for near misses, or ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""

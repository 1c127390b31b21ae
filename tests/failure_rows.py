"""One row of docs/failures.md: an input or damage, what it says, its exit status, what is kept.

Each test file that runs failure cases lists them as Rows (its TABLE), built from the
same words its tests assert; tests/project/test_failure_table.py renders every file's rows
into docs/failures.md and fails when the page and the rows differ.
"""

import dataclasses

VERDICTS = ("clear", "tolerated", "unclear", "traceback", "silently wrong", "lost", "hang")


@dataclasses.dataclass(frozen=True)
class Row:
  """A case: `damage` given to `command`; `message` (its start and its fix) as the test checks."""

  damage: str  # The input or the damage, in words.
  command: str  # What runs on it (main, route, evaluate, serve, the elastic driver, ...).
  message: str  # The one line (its start, then the fix's words), or what the command does.
  exit: int  # The exit status: 1 (a user error), 130 (Ctrl-C), 0 (tolerated).
  kept: str  # What "nothing lost" means for the case and how its test shows it.
  test: str  # The test that runs it.
  verdict: str = "clear"  # VERDICTS: clear (one line, the fix), tolerated (runs on, correct).

  def __post_init__(self):
    assert self.verdict in VERDICTS, self.verdict

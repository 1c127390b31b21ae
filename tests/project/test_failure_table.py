"""docs/failures.md is the table of the failure cases the tests run, and stays so.

Every row comes from a test file's cases (tests/commands/test_failures.py's FAILURES, each
other file's TABLE, built from the words its tests assert); this test fails when
the page differs from them. After changing a case:

    python tests/project/test_failure_table.py   # rewrites docs/failures.md
"""

import collections
import os
import sys

if __name__ == "__main__":  # As a script: tests/ and its folders on sys.path, as under pytest.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import conftest  # noqa: F401  # pylint: disable=unused-import

import test_concurrent_cache
import test_config_derived
import test_elastic_damage
import test_ray_hygiene
import test_workdir_lock

import test_damaged_files
import test_failures
from failure_rows import VERDICTS
from failure_rows import Row
from helpers import ROOT

PAGE = os.path.join(ROOT, "docs", "failures.md")
_TABLES = (
  test_workdir_lock,
  test_damaged_files,
  test_elastic_damage,
  test_ray_hygiene,
  test_concurrent_cache,
  test_config_derived,
)


def _words(s: str) -> str:
  return s.replace("{w}", "WORKDIR").replace("{t}", "DIR")


def rows() -> list[Row]:
  """Every case: test_failures' (exit 1, one line, every file byte for byte), then the TABLEs."""
  out = [
    Row(
      c.name,
      c.entry,
      " … ".join(_words(w) for w in c.want),
      1,
      "every file under the case's folder, byte for byte",
      "tests/commands/test_failures.py",
    )
    for c in test_failures.FAILURES
  ]
  for module in _TABLES:
    out += module.TABLE
  return out


def _cell(s) -> str:
  return str(s).replace("|", "\\|").replace("\n", " ")


def render(table: list[Row]) -> str:
  """The page: what the table holds, the counts by verdict, then one row per case."""
  counts = collections.Counter(r.verdict for r in table)
  lines = [
    "# What each bad input and damaged file does",
    "",
    "Every row is a case a test runs (the last column names it);",
    "`tests/project/test_failure_table.py` fails when this page and the tests' cases differ, and",
    "`python tests/project/test_failure_table.py` writes it again. A **clear** case stops the",
    "command with one line on stderr naming the",
    "problem and the fix (exit status 1; 130 for Ctrl-C), before anything written is changed; a",
    "**tolerated** one goes on and ends right (a line says what it did where it matters). The",
    "message column holds the words the test checks (`…` where the test checks no more; WORKDIR",
    "and DIR stand for the run's folder and the case's). *Nothing lost* says what the test",
    "compares: files byte for byte, or a run's final state bit for bit with the run that met no",
    "fault. Files are written whole (a temporary name renamed into place), checkpoints carry a",
    "crc32 of every row, elastic storage a CRC-32 of every array and JSON item, so a damaged",
    "file is seen when it is read: docs/storage.md and docs/elastic.md say how each is repaired.",
    "",
    f"{len(table)} cases: " + ", ".join(f"{counts.get(v, 0)} {v}" for v in VERDICTS) + ".",
    "",
    "| # | input or damage | command | message | exit | nothing lost | verdict | test |",
    "|---:|---|---|---|---:|---|---|---|",
  ]
  for i, r in enumerate(table, 1):
    cells = (r.damage, r.command, r.message, r.exit, r.kept, r.verdict, r.test)
    lines.append(f"| {i} | " + " | ".join(_cell(c) for c in cells) + " |")
  return "\n".join(lines) + "\n"


def test_the_page_is_the_tests_cases():
  with open(PAGE) as f:
    page = f.read()
  assert page == render(rows()), (
    "docs/failures.md is stale: python tests/project/test_failure_table.py"
  )


def test_over_a_hundred_cases_none_unclear_lost_wrong_or_hung():
  table = rows()
  assert len(table) >= 100
  assert len({(r.damage, r.command) for r in table}) == len(table)  # Each case once.
  assert {r.verdict for r in table} <= {"clear", "tolerated"}
  clear = [r for r in table if r.verdict == "clear"]
  assert all(r.exit in (1, 130) for r in clear)


if __name__ == "__main__":
  with open(PAGE, "w") as f:
    f.write(render(rows()))
  print(f"wrote {PAGE}", file=sys.stderr)

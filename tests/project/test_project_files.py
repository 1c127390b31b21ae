"""The project files hold what they say: one ruff pin, markers documented, links that resolve."""

import os
import re
import tomllib

import pytest

from helpers import ROOT


def _read(*parts: str) -> str:
  with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
    return f.read()


def test_ci_pre_commit_and_the_test_extra_pin_the_same_ruff():
  extra = tomllib.loads(_read("pyproject.toml"))["project"]["optional-dependencies"]["test"]
  (pin,) = [r for r in extra if r.startswith("ruff==")]
  assert re.findall(r"ruff==[\d.]+", _read(".ci", "run")) == [pin]
  assert re.findall(r"ruff==[\d.]+", _read(".pre-commit-config.yaml")) == [
    pin,
    pin,
  ]  # format, check


def test_every_marker_is_registered_and_contributing_names_it_with_the_commands():
  ini = tomllib.loads(_read("pyproject.toml"))["tool"]["pytest"]["ini_options"]
  assert "--strict-markers" in ini["addopts"]
  names = {m.split(":")[0] for m in ini["markers"]}
  assert names == {"slow", "ci", "ray", "aot", "cli", "multiprocess"}
  contributing = _read("CONTRIBUTING.md")
  for name in names:
    assert f"| `{name}` |" in contributing, name
  assert 'python -m pytest -q -m "not ray and not aot" tests' in contributing
  assert 'python -m pytest -q -m "not ray and not aot" tests' in _read("README.md")


def test_the_changelog_is_newest_first():
  days = re.findall(r"^### (\d{4}-\d{2}-\d{2})$", _read("CHANGELOG.md"), re.M)
  assert len(days) >= 5 and days == sorted(days, reverse=True) and len(set(days)) == len(days)


def _anchors(markdown: str) -> set[str]:
  """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
  heads = re.findall(r"^#+ (.+)$", markdown, re.M)
  return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_each_headline_figure_links_a_page_and_heading_that_exist():
  page = _read("docs", "results", "README.md")
  table = page.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
  rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| question")]
  assert len(rows) == 5
  for row in rows:
    (link,) = re.findall(r"\]\(([^)]+)\)\s*\|$", row)
    path, _, anchor = link.partition("#")
    target = os.path.normpath(os.path.join(ROOT, "docs", "results", path))
    assert os.path.isfile(target), link
    if anchor:
      with open(target, encoding="utf-8") as f:
        assert anchor in _anchors(f.read()), link


@pytest.mark.parametrize("name", ["bug_report.md", "feature_request.md"])
def test_the_issue_templates_have_their_front_matter(name):
  text = _read(".github", "ISSUE_TEMPLATE", name)
  front = text.split("---\n")[1]
  assert re.search(r"^name: \S", front, re.M) and re.search(r"^about: \S", front, re.M)

"""BUILD_NOTES.md stays a reference: short, in its sections, without dates, commit hashes or a diary.

Owns: the shape checks of BUILD_NOTES.md (at most `MAX_LINES` lines; the sections of `SECTIONS` in order; a results
summary of at most `MAX_RESULTS_LINES` lines; each design decision and known issue at most `MAX_ITEM_LINES` lines) and
the patterns that find a date, a commit hash or a diary phrase in a line.

Invariants: the file is read as text (no jax, no package import), so this runs in every test tier. Dates and hashes
belong to git and to the generated header of benchmarks/RESULTS.md, which is not checked here. Each pattern is tested
on strings it must and must not match, so a pattern loosened or tightened by accident fails here first.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

NOTES = Path(__file__).resolve().parents[1] / "BUILD_NOTES.md"
MAX_LINES = 250
MAX_RESULTS_LINES = 40
MAX_ITEM_LINES = 4
#: The level-2 headings, in order.
SECTIONS = ("Build and test", "Versions and why", "Architecture", "Design decisions", "Known issues", "Results summary")

_MONTH = (
    r"(?:January|February|March|April|May|June|July|August|September|October|November|December"
    r"|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sept?|Oct|Nov|Dec)\b\.?"
)
#: A calendar date, a day with a month name, a clock time, or a word that dates the text it is in.
DATE = re.compile(
    r"\b\d{4}[-/]\d{1,2}[-/]\d{1,2}\b"  # 2026-12-06, 2026/12/6
    rf"|\b{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?\b"  # Dec 5, December 5th
    rf"|\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}(?:\s|$)"  # 5 Dec
    r"|\b(?:[01]?\d|2[0-3]):[0-5]\d\b"  # 16:04
    r"|(?i:\b(?:today|yesterday|tomorrow|tonight|this (?:morning|afternoon|evening|week|month)"
    r"|last (?:night|week|month)|\d+ (?:hours?|days?|weeks?|months?) ago)\b)"
)
#: 7 to 40 lower-case hex digits with at least one letter and one digit, as a word: what `git log` abbreviates to.
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
#: Phrases of a diary rather than a reference.
DIARY = re.compile(r"(?i)\bnot kept\b|\bwas tried\b|\bwe tried\b")


def _lines() -> list[str]:
    return NOTES.read_text(encoding="utf-8").splitlines()


def _section(lines: list[str], title: str) -> list[str]:
    """The lines under `## title`, up to the next level-2 heading."""
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _items(section: list[str]) -> list[list[str]]:
    """The top-level bullets of a section, each with its indented continuation lines."""
    items: list[list[str]] = []
    for line in section:
        if line.startswith("- "):
            items.append([line])
        elif items and line.startswith("  ") and items[-1]:
            items[-1].append(line)
        elif items:
            items.append([])  # anything else ends the bullet before it
    return [item for item in items if item]


def test_at_most_max_lines():
    assert len(_lines()) <= MAX_LINES, f"BUILD_NOTES.md has {len(_lines())} lines; at most {MAX_LINES}"


def test_sections_in_order():
    headings = [line[3:] for line in _lines() if line.startswith("## ")]
    assert headings == list(SECTIONS)


def test_results_summary_is_short():
    assert len(_section(_lines(), "Results summary")) <= MAX_RESULTS_LINES


@pytest.mark.parametrize("title", ["Design decisions", "Known issues"])
def test_each_item_at_most_four_lines(title):
    long = [item[0][:60] for item in _items(_section(_lines(), title)) if len(item) > MAX_ITEM_LINES]
    assert not long, f"{title}: items over {MAX_ITEM_LINES} lines: {long}"


@pytest.mark.parametrize("name", ["date", "commit hash", "diary"])
def test_no_dates_hashes_or_diary(name):
    pattern = {"date": DATE, "commit hash": COMMIT_HASH, "diary": DIARY}[name]
    found = [f"{n}: {m.group(0)!r}" for n, line in enumerate(_lines(), 1) for m in pattern.finditer(line)]
    assert not found, f"BUILD_NOTES.md holds a {name} (git keeps history): {found}"


@pytest.mark.parametrize(
    "text",
    ["2026-12-06", "on 2026/12/6", "Dec 5", "December 05th", "on 5 Dec", "at 16:04", "9:15", "Today", "today's run",
     "yesterday", "this morning", "five runs 3 days ago"],
)  # fmt: skip
def test_date_pattern_finds(text):
    assert DATE.search(text)


@pytest.mark.parametrize(
    "text",
    ["prefill 2048 tokens", "decode:8:1", "fused:1:4", "attention 8:2 x 64", "1.4e-05", "155,114.9 MiB", "Maybe",
     "may 4 rows", "Decode 8 rows", "Marks 3", "tp 2 x ep 4", "3.29 tokens per verify"],
)  # fmt: skip
def test_date_pattern_passes(text):
    assert not DATE.search(text)


@pytest.mark.parametrize("text", ["at 9979b3b", "deab94c", "f8d69af", "(b5c9609)", "0a5b7e6" + "1f" * 16])
def test_commit_hash_pattern_finds(text):
    assert COMMIT_HASH.search(text)


@pytest.mark.parametrize("text", ["155114", "1234567890", "decade", "e2e", "bf16 fp8", "0x1f2e3d4c", "defaced"])
def test_commit_hash_pattern_passes(text):
    assert not COMMIT_HASH.search(text)

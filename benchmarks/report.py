"""How the benchmark results are rendered: a section's `Table`, as text (stdout) or markdown (the
results file, benchmarks/RESULTS.md).

Owns: `Table` (a section's title, notes, column grids and footer), `Grid`, the cell formats every
section's table uses (`median_range`, `quartiles`, `inverse_quartiles`), `machine_line`,
`notes_markdown` (the results file's body: its generated header, then every table) and
`write_notes` (that body between the two marker lines of a file), and `log` (a progress line on
stderr, apart from the tables on stdout). Each section's own table is
in its module (`benchmarks.sections`).

Invariants:
- Every timing is shown as its median with the (min-max) of the repeats; every ratio as the
  ratio of the medians with the quartiles (p25-p75) of the per-round ratios of the alternated
  runs.
- Text and markdown render the same cells (`metrale_jax.text_table`); only the framing differs.
- `write_notes` replaces only what lies between `NOTES_BEGIN` and `NOTES_END`, atomically (a
  temporary file renamed over the original), and refuses a file without both markers.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Sequence

from metrale_jax.text_table import markdown_table, text_table

NOTES_BEGIN = "<!-- bench:results:begin -->"
NOTES_END = "<!-- bench:results:end -->"


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Grid:
    """Columns of cells; every column but those in `left` is right-aligned."""

    headers: Sequence[str]
    rows: Sequence[Sequence[str]]
    left: Sequence[int] = (0,)

    @property
    def right(self) -> list[int]:
        return [i for i in range(len(self.headers)) if i not in self.left]


@dataclasses.dataclass(frozen=True)
class Table:
    """One section's results: a one-line title, note lines, grids, footer lines."""

    title: str
    notes: Sequence[str] = ()
    grids: Sequence[Grid] = ()
    footer: Sequence[str] = ()

    def with_footer(self, *lines: str) -> Table:
        return dataclasses.replace(self, footer=(*self.footer, *lines))

    def text(self) -> str:
        out = [f"== {self.title}", *(f"   {n}" for n in self.notes)]
        for g in self.grids:
            out += text_table(g.headers, g.rows, right=g.right)
        return "\n".join(out + [f"   {f}" for f in self.footer])

    def markdown(self) -> str:
        """The title as a heading, the notes and the footer as one bullet, then the grids."""
        out = [f"#### {self.title}"]
        if self.notes or self.footer:
            out.append("- " + "; ".join([*self.notes, *self.footer]))
        out.append("")
        for g in self.grids:
            out += [*markdown_table(g.headers, g.rows, right=g.right), ""]
        return "\n".join(out).rstrip("\n")


def median_range(s: dict, scale: float = 1e3, fmt: str = ".3f") -> str:
    """A `Stats` dict as 'median (min-max)', scaled (default: seconds as ms)."""
    return f"{s['median'] * scale:{fmt}} ({s['min'] * scale:{fmt}}-{s['max'] * scale:{fmt}})"


def quartiles(s: dict) -> str:
    """A ratio's `Stats` dict as '(p25-p75)'."""
    return f"({s['p25']:.3f}-{s['p75']:.3f})"


def inverse_quartiles(s: dict) -> str:
    """The quartiles of per-round JAX/HF ratios as HF/JAX (p25-p75)."""
    return f"({1 / s['p75']:.2f}-{1 / s['p25']:.2f})"


def machine_line(m: dict) -> str:
    load = m.get("load_average_1_5_15") or []
    return (
        f"machine: {m.get('cpu_count')} cores, load average {'/'.join(str(x) for x in load)} (1/5/15 min), "
        f"jax {m.get('jax')} on {m.get('backend')}, threads per side {m.get('threads', 'default')}"
        + (f", JAX on cpu {m['jax_cpus']} / HF on cpu {m['hf_cpu']}" if m.get("hf_cpu") is not None else "")
        + f", {m.get('time')}"
    )


def notes_markdown(command: str, machine: str, tables: Sequence[Table]) -> str:
    """The results section's body: how it was made, the machine line, then every table."""
    head = f"Written by `{command}` (`make bench`; not edited by hand). {machine}"
    return "\n\n".join([head, *(t.markdown() for t in tables)])


def _split_notes(text: str, path: str) -> tuple[str, str]:
    """(everything up to and including the begin marker's line, the end marker's line onwards)."""
    lines = text.splitlines(keepends=True)
    begin = [i for i, x in enumerate(lines) if x.strip() == NOTES_BEGIN]
    end = [i for i, x in enumerate(lines) if x.strip() == NOTES_END]
    if len(begin) != 1 or len(end) != 1 or begin[0] > end[0]:
        raise ValueError(f"{path} needs one line {NOTES_BEGIN} followed by one line {NOTES_END}; not written")
    return "".join(lines[: begin[0] + 1]), "".join(lines[end[0] :])


def check_notes(path: str) -> None:
    """Raise ValueError (one line) unless `path` holds both marker lines, in order."""
    with open(path) as f:
        _split_notes(f.read(), path)


def write_notes(path: str, body: str) -> None:
    """Replace what lies between the markers of `path` with `body` (see the module invariants)."""
    with open(path) as f:
        before, after = _split_notes(f.read(), path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".bench-notes-", suffix=".md")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(before + body.rstrip("\n") + "\n" + after)
        os.chmod(tmp, os.stat(path).st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

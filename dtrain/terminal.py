"""What dtrain prints for people, made to fit the terminal it is printed on: tables, paragraphs, progress bars.

Every table dtrain prints (the tour's, the planner's, the lessons', ``exercises list``) goes through :func:`table`,
every paragraph of explanation through :func:`paragraph`, every progress bar through :class:`Bar`. The width comes
from :func:`columns`: ``$COLUMNS`` if it is set, else the terminal's width when the stream is a terminal, else no
limit at all: a file or a pipe gets every row of a table on one line, for ``grep`` and ``diff``. (A rank's stdout is
a pipe to ``mpiexec``, so ``dtrain launch`` hands its own terminal's width to the ranks as ``COLUMNS``.)

How a table is fitted; each way is tried only when the one before it does not fit::

    1. every cell on one line, each column as wide as its widest cell       a file, a pipe, a wide terminal
    2. headers wrapped at their spaces, text columns wrapped at their words  numbers never wrap
    3. the notes column taken out and printed under the table, each note after its row's name
    4. the columns dealt into several tables, each repeating the row's name
    5. one block per row, a line per column                                  a very narrow terminal

Numbers are right-aligned (their digits line up), text left-aligned.
"""

from __future__ import annotations

import os
import shlex
import sys
import textwrap
from pathlib import Path

GAP = "  "  # between two columns
WRAP_FLOOR = 16  # a text column is not squeezed below this (or its longest word): narrower reads a word a line
COMFORTABLE = 32  # a text column as wide as this reads well: wider ones grow only once every header fits a line
NOTES_FLOOR = 40  # notes that would get fewer columns than this read better under the table
PROSE = 100  # the widest a paragraph runs, however wide the terminal: long lines are hard to read
NARROWEST = 20  # a $COLUMNS below this is taken as a mistake, not a terminal
UNKNOWN_SIZE = 80  # a terminal that does not know its width is taken to be this wide (as shutil does)


def columns(stream=None) -> int | None:
    """How many columns a line printed on ``stream`` (default: stdout) may take: ``$COLUMNS`` if set, else the
    terminal's width if ``stream`` is a terminal, else None (a file or a pipe: no limit)."""
    given = os.environ.get("COLUMNS", "").strip()
    if given.isdigit() and int(given) >= NARROWEST:
        return int(given)
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():  # (its own size: stdout may be a pipe while stderr is the terminal)
            width = os.get_terminal_size(stream.fileno()).columns
            return max(NARROWEST, width) if width > 0 else UNKNOWN_SIZE  # (script(1) without a terminal says 0)
    except (AttributeError, ValueError, OSError):  # a closed stream, or one with no notion of a terminal
        pass
    return None


def prose_width(width: int | str | None = "auto", stream=None) -> int:
    """The width a paragraph is wrapped to on a line of ``width`` columns ("auto": :func:`columns` of ``stream``;
    None: no limit): that width, but at most :data:`PROSE`."""
    width = columns(stream) if width == "auto" else width
    return PROSE if width is None else min(width, PROSE)


def paragraph(text: str, indent: str = "", hanging: str | None = None, width: int | str | None = "auto") -> str:
    """``text`` wrapped at its spaces to :func:`prose_width` of ``width``, each line starting with ``indent`` (the
    second and later with ``hanging``, if given)."""
    width = prose_width(width)
    return textwrap.fill(text, width=max(width, len(indent) + 10), initial_indent=indent,
                         subsequent_indent=indent if hanging is None else hanging, break_on_hyphens=False,
                         break_long_words=False)  # fmt: skip  # (a path or a URL longer than a line stays whole)


def wrapped(text: str, width: int | str | None = "auto") -> str:
    """Each line of ``text`` wrapped as a :func:`paragraph` of its own, its later lines standing in two further than
    its own indentation (a description of several indented lines keeps its shape)."""
    out = []
    for line in text.splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        out.append(paragraph(line.strip(), indent, indent + "  ", width) if line.strip() else "")
    return "\n".join(out)


def command(words: list[str], indent: str = "", width: int | str | None = "auto") -> str:
    """A shell command a person can copy, broken into lines of ``width`` (see :func:`prose_width`) with the shell's
    own continuation (a backslash ending a line), the later lines standing in by four; an option stays on the line
    of its value."""
    room = prose_width(width) - 2  # (" \\")
    pieces = []  # an option and its value; apart only if the value alone fits a line and the two do not
    for word in map(shlex.quote, words):
        joined = f"{pieces[-1]} {word}" if pieces else ""
        option = pieces and pieces[-1].startswith("-") and " " not in pieces[-1] and not word.startswith("-")
        if option and (len(indent) + 4 + len(joined) <= room or len(indent) + 4 + len(word) > room):
            pieces[-1] = joined
        else:
            pieces.append(word)
    lines, line = [], indent + pieces[0]
    for piece in pieces[1:]:
        if len(line) + 1 + len(piece) > room:
            lines.append(line + " \\")
            line = indent + "    " + piece
        else:
            line += " " + piece
    return "\n".join([*lines, line])


def speed(ours: float, theirs: float, whose: str | None = None) -> str:
    """How a time ``ours`` compares with a time ``theirs``, in words that say which way: "1.50x faster than
    single", "1.16x slower than ddp", "as fast as ddp" (within half a percent); without ``whose`` (a table's cell
    under a header that names the other): "1.50x faster". The one way dtrain says it."""
    than = f" than {whose}" if whose else ""
    if not (ours > 0 and theirs > 0):
        return "-" if whose is None else f"not comparable with {whose}"
    ratio = theirs / ours
    if abs(ratio - 1) < 0.005:
        return "as fast" + (f" as {whose}" if whose else "")
    return f"{ratio:.2f}x faster{than}" if ratio > 1 else f"{1 / ratio:.2f}x slower{than}"


def table(header: list[str], rows: list[list[str]], *, left=(0,), wrap=None, keys: int = 1, notes: int | None = None,
          groups=(), width: int | str | None = "auto", indent: str = "", stream=None) -> str:  # fmt: skip
    """A table of ``rows`` (each a list of strings, as many as ``header``) that fits ``width`` columns.

    ``left``: the columns aligned left (text; the others are numbers, aligned right). ``wrap``: the columns that may
    wrap at their words (default: ``left``). ``keys``: how many leading columns name a row (repeated when the table
    is split; a note is printed after them). ``notes``: a column of long text that may move under the table.
    ``groups``: the columns where a group begins (a split keeps a group together where it can).
    ``width``: "auto" (:func:`columns` of ``stream``), a number, or None (no limit). ``indent`` starts every line.
    A cell is one line of text, each character one column wide (no tabs, newlines or double-width characters).
    """
    header = [str(h) for h in header]
    rows = [[str(c) for c in row] for row in rows]
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row needs {len(header)} cells, one per header: {[len(r) for r in rows]}")
    limit = columns(stream) if width == "auto" else width
    left, wrap = set(left), set(left if wrap is None else wrap)
    natural = _natural(header, rows)
    if limit is None or _span(natural) + len(indent) <= limit:  # 1. every cell on one line
        return _render(header, rows, natural, left, wrap, indent)
    room = limit - len(indent)
    widths = _fit(header, rows, wrap, room, left & wrap)
    if notes is not None and (widths is None or widths[notes] < min(NOTES_FLOOR, natural[notes])):  # 3. notes under
        keep = [i for i in range(len(header)) if i != notes]
        moved = [(" ".join(row[i] for i in range(keys)), row[notes]) for row in rows if row[notes].strip()]
        body = table([header[i] for i in keep], [[row[i] for i in keep] for row in rows], left=_renumber(left, keep),
                     wrap=_renumber(wrap, keep), keys=keys, groups=_renumber(groups, keep), width=limit,
                     indent=indent)  # fmt: skip
        under = [paragraph(f"{name}: {note}", indent + "  ", indent + "      ", limit) for name, note in moved]
        return "\n".join([body, "", f"{indent}{header[notes] or 'notes'}:", *under])
    if widths is not None:  # 2. wrapped
        return _render(header, rows, widths, left, wrap, indent)
    parts = []  # 4. several tables
    for block in _deal(header, rows, wrap, keys, room, set(groups), left & wrap) or []:
        sub, named = [[row[i] for i in block] for row in rows], [header[i] for i in block]
        cells = _fit(named, sub, _renumber(wrap, block), room, _renumber(left & wrap, block))
        if cells is None:
            break
        parts.append(_render(named, sub, cells, _renumber(left, block), _renumber(wrap, block), indent))
    else:
        if parts:
            return "\n\n".join(parts)
    return _records(header, rows, keys, room, indent)  # 5. a block per row


def _natural(header, rows) -> list[int]:
    return [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]


def _span(widths) -> int:
    return sum(widths) + len(GAP) * (len(widths) - 1)


def _longest_word(texts) -> int:
    return max((len(word) for text in texts for word in text.split()), default=0)


def _renumber(indices, kept: list[int]) -> set[int]:
    return {kept.index(i) for i in indices if i in kept}


def _fit(header, rows, wrap, room: int, hanging=frozenset()) -> list[int] | None:
    """Column widths within ``room``, headers wrapped and ``wrap`` columns wrapped as far as need be (a ``hanging``
    one's later lines stand in by one); None if even the narrowest they may be does not fit."""
    natural = _natural(header, rows)
    least = []
    for i, head in enumerate(header):
        cells = [row[i] for row in rows]
        if i in wrap:
            longest = _longest_word([head, *cells])
            narrowest = max(longest, min(natural[i], WRAP_FLOOR))
            least.append(max(narrowest, longest + 1) if i in hanging and narrowest < natural[i] else narrowest)
        else:
            least.append(max(_longest_word([head]), max((len(c) for c in cells), default=0)))
    if _span(least) > room:
        return None
    widths, spare = list(least), room - _span(least)
    texts = [i for i in wrap if i < len(header)]

    def grow(columns, upto) -> None:  # one column at a time, the narrowest first, so that they grow together
        nonlocal spare
        while spare > 0 and (short := [i for i in columns if widths[i] < upto(i)]):
            widths[min(short, key=lambda i: widths[i])] += 1
            spare -= 1

    # The spare room goes first to the text columns, up to a width that reads well; then to whole headers, the
    # cheapest first, so that each fits on one line; then to the text columns again, up to their widest cell.
    grow(texts, lambda i: min(natural[i], COMFORTABLE))
    for i in sorted(range(len(header)), key=lambda i: natural[i] - widths[i]):
        if i not in texts and 0 < natural[i] - widths[i] <= spare:
            spare -= natural[i] - widths[i]
            widths[i] = natural[i]
    grow(texts, lambda i: natural[i])
    return widths


def _render(header, rows, widths, left, wrap, indent) -> str:
    def lines_of(text: str, i: int, is_header: bool) -> list[str]:
        if len(text) <= widths[i]:
            return [text]
        hanging = "" if is_header or i not in left else " "  # (a wrapped name's later lines stand in by one)
        return textwrap.wrap(text, widths[i], subsequent_indent=hanging, break_long_words=False,
                             break_on_hyphens=False) or [""]  # fmt: skip

    def join(cells: list[list[str]], bottom: bool = False) -> list[str]:
        height = max(len(c) for c in cells)
        padded = [([""] * (height - len(c)) + c) if bottom else (c + [""] * (height - len(c))) for c in cells]
        out = []
        for k in range(height):
            parts = [p[k].ljust(widths[i]) if i in left else p[k].rjust(widths[i]) for i, p in enumerate(padded)]
            out.append((indent + GAP.join(parts)).rstrip())
        return out

    out = join([lines_of(h, i, True) for i, h in enumerate(header)], bottom=True)
    out.append(indent + GAP.join("-" * w for w in widths))
    for row in rows:
        out += join([lines_of(c, i, False) if i in wrap else [c] for i, c in enumerate(row)])
    return "\n".join(out)


def _deal(header, rows, wrap, keys: int, room: int, groups=(), hanging=frozenset()) -> list[list[int]] | None:
    """The columns after the ``keys`` dealt, in order, into as few tables as fit ``room``, each led by the keys; a
    table ends before a column of ``groups`` (where a group of columns starts) rather than inside the group, where
    it can."""

    def fits(block) -> bool:
        return _fit([header[j] for j in block], [[r[j] for j in block] for r in rows], _renumber(wrap, block),
                    room, _renumber(hanging, block)) is not None  # fmt: skip

    blocks, block = [], list(range(keys))
    for i in range(keys, len(header)):
        if fits([*block, i]):
            block.append(i)
            continue
        if len(block) == keys:  # not even one column beside the keys fits
            return None
        starts = [k for k, j in enumerate(block) if j in groups and k > keys]  # (a group begun in this table)
        cut = len(block) if i in groups or not starts else starts[-1]  # (column i starting a group: cut before it)
        if not fits([*range(keys), *block[cut:], i]):  # (the group does not fit a table of its own: cut inside it)
            cut = len(block)
        blocks.append(block[:cut])
        block = [*range(keys), *block[cut:], i]
        if not fits(block):
            return None
    blocks.append(block)
    return blocks


def _records(header, rows, keys: int, room: int, indent: str) -> str:
    """Each row as a block: its name, then a line per column (``header  value``), values wrapped to the room; a
    header too long to stand beside its value has a line of its own. No rows: the headers, as a paragraph."""
    if not rows or keys >= len(header):  # (no rows, or nothing but names: the headers, then the names)
        names = [" ".join(row[:keys]) for row in rows]
        return "\n".join([paragraph(", ".join(header), indent, indent + "  ", room + len(indent)), *names])
    named = min(max((len(h) for h in header[keys:]), default=0), room // 2)

    def wrapped(text: str, width: int) -> list[str]:
        return textwrap.wrap(text, max(width, 1), break_long_words=False, break_on_hyphens=False) or [""]

    out = []
    for row in rows:
        out += wrapped(" ".join(row[:keys]), room)
        for head, cell in zip(header[keys:], row[keys:]):
            if len(head) > named:  # (the value under its header, as far in as its longest word lets it)
                out += [f"  {line}" for line in wrapped(head, room - 2)]
                inset = next((n for n in (4, 2) if _longest_word([cell]) <= room - n), 0)
                out += [" " * inset + line for line in wrapped(cell, room - inset)]
                continue
            lead = f"  {head.ljust(named)}  "
            out += [
                (lead if k == 0 else " " * len(lead)) + line for k, line in enumerate(wrapped(cell, room - len(lead)))
            ]
    return "\n".join((indent + line).rstrip() for line in out)


def tell(text: str) -> None:
    """One line (or a few) for a person on stderr, if stderr can still take it: a closed terminal or pipe must not
    stop what is being done (a job's cleanup). Messages stay whole lines, for grep and for logs."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


STDOUT = "-"  # an output file named "-" is standard output, as every Unix tool reads it


def to_stdout(*paths) -> bool:
    """Whether any of these output paths is standard output (then what is printed for people goes to stderr)."""
    return any(str(path) == STDOUT for path in paths if path is not None)


def human(*paths):
    """Where the lines for people go when a command writes these outputs: stderr if one of them is stdout."""
    return sys.stderr if to_stdout(*paths) else sys.stdout


def write_output(path, data: str | bytes) -> None:
    """Write ``data`` to the file ``path``, or to standard output if ``path`` is "-" (the process's file descriptor
    1 itself, so that it arrives whole even where Python's ``sys.stdout`` was pointed at stderr for the people's
    lines); a file's folder is made if need be."""
    raw = data.encode() if isinstance(data, str) else data
    if str(path) != STDOUT:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(raw)
        return
    for stream in (sys.stdout, sys.stderr):  # what was printed before comes before
        stream.flush()
    view = memoryview(raw)
    while view:
        view = view[os.write(1, view) :]


class Bar:
    """A progress bar of ``total`` steps on stderr, when stderr is a terminal; nothing anywhere else (a log or a pipe
    gets the lines a command prints, not a bar's redrawing). It takes the terminal's width and leaves no trace when
    it closes: the line that follows it says how the work ended."""

    def __init__(self, total: int, title: str, unit: str = "it", show: bool = True):
        self.bar = None
        if show and sys.stderr.isatty():
            from tqdm import tqdm

            try:  # a terminal that does not know its size (script(1) without one says 0 columns): $COLUMNS or 80
                known = os.get_terminal_size(sys.stderr.fileno()).columns > 0
            except OSError:
                known = False
            width = {"dynamic_ncols": True} if known else {"ncols": columns(sys.stderr) or UNKNOWN_SIZE, "nrows": 24}
            self.bar = tqdm(total=total, desc=title, unit=unit, leave=False, **width)

    def update(self, done: int) -> None:
        """``done`` steps of the total are done now."""
        if self.bar is not None and done > self.bar.n:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def progress(iterable, total: int, title: str, show: bool = True):
    """``iterable``, with a :class:`Bar` counting its items on a terminal (and nothing but ``iterable`` elsewhere)."""
    bar = Bar(total, title, show=show)
    if bar.bar is None:
        yield from iterable
        return
    with bar:
        for i, item in enumerate(iterable, 1):
            yield item
            bar.update(i)

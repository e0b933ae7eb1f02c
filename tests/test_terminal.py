"""dtrain.terminal: tables and paragraphs that fit the terminal, "-" as standard output, one way to say "faster"."""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys

import pytest

from dtrain import terminal

HEADER = ["paradigm", "test acc", "sent B/step", "costs()", "what to notice"]
ROWS = [
    ["single (1 process)", "97.77%", "0", "0", "the reference: sends nothing; holds the model and its gradients"],
    ["ddp hierarchical (2 nodes of 2)", "97.77%", "105,040", "105,040",
     "single's curve (to 8e-07); a node's leader sends 2.00x the gradient, the other ranks 1.00x"],
]  # fmt: skip


def widest(text: str) -> int:
    return max(map(len, text.splitlines()))


def test_without_a_limit_every_row_is_one_line_numbers_right_text_left():
    text = terminal.table(HEADER, ROWS, left=(0, 4), width=None)
    lines = text.splitlines()
    assert len(lines) == 2 + len(ROWS)  # header, rule, a line per row
    assert lines[0].startswith("paradigm   ") and lines[0].endswith("what to notice")
    assert lines[2].startswith("single (1 process) ") and "     0        0  the reference" in lines[2]
    assert lines[1].split("  ")[2] == "-" * len("sent B/step")


@pytest.mark.parametrize("columns", [80, 100, 120, 60, 40, 30])
def test_every_width_fits_and_keeps_every_cell(columns):
    text = terminal.table(HEADER, ROWS, left=(0, 4), notes=4, width=columns)
    assert widest(text) <= columns, text
    words = " ".join(text.split())
    for row in ROWS:  # every word of every cell is still there (a wrapped cell's words are whole)
        assert all(word in words for cell in row for word in cell.split())


def test_at_80_columns_the_notes_go_under_the_table_each_after_its_row_name():
    text = terminal.table(HEADER, ROWS, left=(0, 4), notes=4, width=80)
    table, notes = text.split("\n\nwhat to notice:\n")
    assert "what to notice" not in table
    assert table.splitlines()[0].split() == " ".join(HEADER[:4]).split()  # (the rest fits: headers on one line)
    assert notes.splitlines()[0] == "  single (1 process): the reference: sends nothing; holds the model and its"
    assert notes.splitlines()[1] == "      gradients"


def test_a_wide_enough_terminal_keeps_the_notes_in_their_column_wrapped():
    text = terminal.table(HEADER, ROWS, left=(0, 4), notes=4, width=140)
    lines = text.splitlines()
    assert "what to notice:" not in text and lines[0].endswith("what to notice") and widest(text) <= 140
    start = lines[0].index("what to notice")  # the notes' column: a wrapped note goes on in it, under itself
    ddp = next(i for i, line in enumerate(lines) if line.startswith("ddp hierarchical"))
    assert lines[ddp][start:].startswith("single's curve") and lines[ddp + 1][:start].strip() == ""
    assert lines[ddp + 1][start:].split()[-1] == "1.00x"


def test_too_many_columns_are_dealt_into_tables_that_repeat_the_key_and_keep_groups():
    header = ["", "configuration", "step ms", "comm ms", "sent", "params", "grads", "optim", "memory"]
    rows = [["*", "tp4", "6.49", "0.602", "1.0 MiB", "670.5 KiB", "670.5 KiB", "670.5 KiB", "3.9 MiB"]] * 3
    text = terminal.table(header, rows, left=(0, 1), keys=2, groups=(2, 5), width=60)
    blocks = text.split("\n\n")
    assert len(blocks) == 2 and all("configuration" in block for block in blocks)
    assert "params" in blocks[1] and "sent" in blocks[0]  # the memory group starts the second table
    assert widest(text) <= 60


def test_a_column_that_starts_a_group_starts_the_next_table():
    header = ["name", "width", "parameters", "a", "b", "c", "d"]
    rows = [["layer 0", "512", "401,920", "1.0 MiB", "2.0 MiB", "3.0 MiB", "4.0 MiB"]]
    text = terminal.table(header, rows, groups=(1, 3), width=30)  # (not cut at "width": "a" starts a group itself)
    assert [block.splitlines()[0].split() for block in text.split("\n\n")] == [
        ["name", "width", "parameters"], ["name", "a", "b"], ["name", "c", "d"]]  # fmt: skip


def test_a_word_longer_than_a_line_stays_whole():
    path = "/tmp/pytest-of-root/pytest-12/test_a_long_name_0/lesson.json"
    assert path in terminal.paragraph(f"measurements written to {path}", width=40).splitlines()


def test_a_very_narrow_terminal_gets_a_block_per_row():
    text = terminal.table(HEADER, ROWS, left=(0, 4), width=24)
    assert widest(text) <= 24
    assert text.splitlines()[0] == "single (1 process)" and "97.77%" in text.splitlines()[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sets a pseudo-terminal's size with TIOCSWINSZ")
@pytest.mark.parametrize(("size", "expected"), [(137, 137), (0, terminal.UNKNOWN_SIZE)])
def test_columns_measures_the_terminal_of_the_stream_it_is_given(monkeypatch, size, expected):
    """The stream's own terminal (stdout may be a pipe while stderr is the terminal); one that does not know its
    size (script(1) without a terminal says 0 columns) is taken to be 80 wide."""
    import fcntl
    import pty
    import struct
    import termios

    monkeypatch.delenv("COLUMNS", raising=False)
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, size, 0, 0))
    with os.fdopen(follower, "w") as stream:
        assert terminal.columns(stream) == expected
    os.close(leader)


@pytest.mark.parametrize(
    ("header", "rows", "how", "columns"),
    [(["name"], [["x" * 30]], {}, 20),  # one column, wider than the room: its one word, whole
     (["name", "note", "more"], [["k", "a " + "x" * 20, "b " + "y" * 20]], {"left": (0, 1, 2)}, 48),  # hanging lines
     (["name", "c1", "c2", "c3"], [["abcde", "1" * 5, "2" * 10, "3" * 14]], {"groups": (2,)}, 30),  # a group too wide
     (["config", "sent/step", "compute ms"], [["tp4 x dp2 1f1b", "1,234,567,890", "0.12"]], {}, 16),  # blocks
     (["alpha beta", "gamma"], [], {}, 8)],  # no rows
    ids=["one-column", "hanging", "group", "blocks", "no-rows"],
)  # fmt: skip
def test_awkward_tables_fit_without_breaking_a_number(header, rows, how, columns):
    text = terminal.table(header, rows, width=columns, **how)
    assert widest(text) <= max([columns] + [len(w) for r in rows for c in r for w in c.split()]), text
    for row in rows:
        for cell in row:
            assert all(word in text.split() for word in cell.split()), (cell, text)  # whole: never cut
    shown = text.replace(",", " ").split()  # every header but the row names' (a block per row shows the names alone)
    assert all(word in shown for h in (header[1:] if rows else header) for word in h.split())


def test_columns_reads_COLUMNS_then_the_terminal_and_a_pipe_has_no_limit(monkeypatch):
    monkeypatch.setenv("COLUMNS", "97")
    assert terminal.columns(io.StringIO()) == 97
    monkeypatch.setenv("COLUMNS", "nonsense")
    assert terminal.columns(io.StringIO()) is None
    monkeypatch.delenv("COLUMNS")
    assert terminal.columns(io.StringIO()) is None and terminal.prose_width(None) == terminal.PROSE


def test_a_command_breaks_between_options_with_the_shells_continuation():
    words = ["dtrain", "launch", "-n", "4", "-m", "dtrain", "train", "--paradigm", "tp", "--hidden", "512,512",
             "--batch-size", "256", "--dtype", "float32", "--optimizer", "sgd", "--label", "two words"]  # fmt: skip
    text = terminal.command(words, "    ", width=50)
    assert widest(text) <= 50 and all(line.endswith(" \\") for line in text.splitlines()[:-1])
    assert shlex.split(text.replace("\\\n", " ")) == words  # a shell reads the same words back
    assert not any(line.split()[-2].startswith("-") for line in text.splitlines()[:-1])  # an option beside its value
    too_long = terminal.command(["dtrain", "--hidden", ",".join(["6144"] * 12), "--lr", "0.1"], width=40)
    assert too_long.splitlines()[1].strip().startswith("--hidden 6144,")  # (no option left dangling at a line's end)
    long = terminal.command(["dtrain", "--checkpoint-dir", "/a/long/folder/for/checkpoints"], width=40)
    assert widest(long) <= 40 and long.splitlines() == [
        "dtrain --checkpoint-dir \\",
        "    /a/long/folder/for/checkpoints",
    ]


def test_speed_says_which_way():
    assert terminal.speed(1.0, 1.5, "single") == "1.50x faster than single"
    assert terminal.speed(1.5, 1.0, "single") == "1.50x slower than single"
    assert terminal.speed(1.0, 1.001, "ddp") == "as fast as ddp"
    assert (terminal.speed(2.0, 1.0), terminal.speed(1.0, 3.0), terminal.speed(0.0, 1.0)) == (
        "2.00x slower", "3.00x faster", "-")  # fmt: skip


def test_dash_writes_to_standard_output_itself(tmp_path):
    code = ("import sys; from dtrain import terminal; sys.stdout = sys.stderr; print('for people'); "
            "terminal.write_output('-', 'data\\n'); terminal.write_output(sys.argv[1], b'file')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sub" / "out.bin")], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "data\n" and done.stderr == "for people\n"
    assert (tmp_path / "sub" / "out.bin").read_bytes() == b"file"

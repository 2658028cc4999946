"""The README tells the truth about the command line: its command reference is what the
commands' --help prints, and its first screen shows the demo's table as the demo prints it."""

from __future__ import annotations

import re
from pathlib import Path

from kvring.bench.demo import COLUMNS
from kvring.cli.reference import BEGIN, END, reference

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_command_reference_is_what_the_commands_print():
    text = README.read_text()
    assert BEGIN in text and END in text, "no command reference in the README: python -P -m kvring.cli.reference"
    current = BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END
    assert current == reference(), "the README's command reference is stale: python -P -m kvring.cli.reference"


def test_every_option_is_in_the_reference():
    ref = reference()
    for option in ("--events-port", "--limit", "--tls-dir", "--no-tls", "--version"):
        assert option in ref


def test_the_first_screen_shows_the_demos_table_with_its_columns():
    first_block = re.search(r"```text\n(.*?)```", README.read_text(), re.S).group(1)
    header = next(line for line in first_block.splitlines() if "prompt" in line)
    positions = [header.find(col) for col in COLUMNS]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), (header, COLUMNS)

"""Knobs declared once: the README's knob table is the one the specs print."""

import re
import subprocess
import sys
from pathlib import Path

from agent.knobs import markdown_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readmes_knob_table_is_the_one_the_specs_print():
    printed = subprocess.run([sys.executable, "-m", "agent.knobs", "--markdown"],
                             capture_output=True, text=True, check=True,
                             cwd=README.parent).stdout
    assert printed == markdown_table() + "\n"
    block = re.search(r"<!-- knobs: python -m agent.knobs --markdown -->\n(.*?)<!-- /knobs -->",
                      README.read_text(), re.S)
    assert block is not None, "the README has no generated knob table"
    assert block.group(1) == printed, "README's knob table: python -m agent.knobs --markdown"

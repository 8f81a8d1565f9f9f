"""Knobs declared once: the README's knob table is the one the specs print, its keys table
has the specs' keys and the dashboard's own, and the Trainer's own checkpoint keeps the
knobs bound on it."""

import re
import subprocess
import sys
from pathlib import Path

import torch

import agent
from agent.wire.knobs import STANDARD_KNOBS, markdown_table
from gpuopt import Trainer
from gpuwatch.app import GpuwatchApp
from tests.training import BlockNet, digits_loader

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readmes_knob_table_is_the_one_the_specs_print():
    printed = subprocess.run([sys.executable, "-m", "agent.wire.knobs", "--markdown"],
                             capture_output=True, text=True, check=True,
                             cwd=README.parent).stdout
    assert printed == markdown_table() + "\n"
    block = re.search(r"<!-- knobs: python -m agent.wire.knobs --markdown -->\n"
                      r"(.*?)<!-- /knobs -->", README.read_text(), re.S)
    assert block is not None, "the README has no generated knob table"
    assert block.group(1) == printed, "README's knob table: python -m agent.wire.knobs --markdown"


def test_the_trainers_checkpoint_keeps_every_setting_of_its_own_the_agent_binds(run_dir):
    """``Trainer.SETTINGS`` lives in gpuopt, which cannot read the specs: every knob the
    agent binds on a Trainer that is a Trainer setting must be in it, or the Trainer's own
    checkpoint would lose it."""
    model = BlockNet()
    model.head = torch.nn.Sequential(torch.nn.Dropout(0.1), model.head)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters()),
                      torch.nn.functional.cross_entropy, digits_loader())
    monitor = agent.attach(trainer)
    try:
        bound = set(monitor.knobs.values())
    finally:
        monitor.close()
    assert {"precision", "checkpointing", "dropout", "weight_decay"} <= bound
    settings = {name for name in bound if hasattr(Trainer, name)}
    assert settings <= set(Trainer.SETTINGS), settings - set(Trainer.SETTINGS)


def _readme_keys_table() -> dict[str, list[str]]:
    """The README's table of dashboard keys: the keys of each row (``a`` / ``A``, ``?``,
    ``q`` as separate keys) by its knob column (empty for the keys of no knob; ``any``)."""
    block = re.search(r"\| key \| knob \| \|\n\|---\|---\|---\|\n((?:\|.*\n)+)",
                      README.read_text())
    assert block is not None, "the README has no keys table"
    rows: dict[str, list[str]] = {}
    for line in block.group(1).splitlines():
        keys, knob = line.split("|")[1:3]
        rows.setdefault(knob.strip("` "), []).extend(re.findall(r"`([^`]+)`", keys))
    return rows


def test_the_readmes_keys_table_lists_every_knobs_keys_and_the_apps_own():
    rows = _readme_keys_table()
    with_keys = {name: [key.key for key in spec.keys]
                 for name, spec in STANDARD_KNOBS.items() if spec.keys}
    assert len(with_keys) >= 7  # the specs were read
    assert {knob: keys for knob, keys in rows.items() if knob not in ("", "any")} == with_keys
    names = {"question_mark": "?", "colon": ":"}
    own = {names.get(binding.key, binding.key) for binding in GpuwatchApp.BINDINGS
           if (binding.id or "").partition(".")[0] not in ("timeline", *STANDARD_KNOBS)}
    assert own == set(rows[""]) | set(rows["any"])

"""Knobs declared once: the README's knob table is the one the specs print, and the
Trainer's own checkpoint keeps the knobs bound on it."""

import re
import subprocess
import sys
from pathlib import Path

import torch

import agent
from agent.wire.knobs import markdown_table
from gpuopt import Trainer
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

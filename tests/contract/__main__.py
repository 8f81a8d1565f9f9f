"""Train one contract driver until stopped: ``python -m tests.contract NAME DIR``.

Prints ``step N <run log path>`` once the first optimizer step is recorded, then trains
on (the SIGTERM check of ``tests/test_contract.py`` stops it)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.contract import Recorder, all_drivers


def main() -> None:
    name, directory = sys.argv[1], Path(sys.argv[2])
    [driver] = [driver for driver in all_drivers() if driver.name == name]
    driver.train(steps=10**6, commands=[], checkpoint_dir=directory, resume_from=None,
                 recorder=Recorder(announce=True))


if __name__ == "__main__":
    main()

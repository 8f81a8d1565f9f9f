"""The README's examples run as written and publish their steps."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script", [
    "trainer_attach.py", "hand_written_loop.py",
    *(pytest.param(script, marks=pytest.mark.slow)  # importing the framework: 10-20 s
      for script in ("lightning_attach.py", "hf_attach.py"))])
def test_example_runs_and_cleans_up(script, run_dir):
    result = subprocess.run([sys.executable, str(EXAMPLES / script), "--max-steps", "10"],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr
    assert "watch it with `gpuwatch`" in result.stdout
    last = result.stdout.splitlines()[-1]  # the end, said: steps, final loss, run log
    assert re.fullmatch(r"run \S+ ended: steps trained 10, final loss \d\S*, run log "
                        r"\S+\.runlog \(`gpuwatch runs --all`\)", last), last
    assert Path(last.split(", run log ")[1].split(" (")[0]).is_file()
    assert list(Path(run_dir).glob("*.json")) == []  # run file removed at exit

"""The README's examples run as written and publish their steps."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.wire import runs
from gpuwatch.client import send_command

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


def test_the_loop_example_stops_cleanly_on_stop_now(run_dir):
    """``stop=now`` ends the hand-written loop example at that boundary: exit 0, no
    traceback. Its loop fetches with ``next(batches)``, which raises StopIteration once
    the stopped ``run.loader()`` ends, unless the loop leaves on ``run.stopping`` first."""
    example = subprocess.Popen([sys.executable, str(EXAMPLES / "hand_written_loop.py")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = example.stdout.readline()  # "run <id>: watch it with `gpuwatch`"
        assert "watch it with `gpuwatch`" in first, first + example.stderr.read()
        info = runs.find_run(first.split()[1].rstrip(":"))
        assert info is not None
        reply = send_command(info, "stop", "now")
        assert reply["ok"], reply
        out, err = example.communicate(timeout=120)
    finally:
        if example.poll() is None:
            example.kill()
            example.communicate()
    assert example.returncode == 0, err
    assert "Traceback" not in err, err
    last = (first + out).splitlines()[-1]
    assert re.fullmatch(r"run \S+ ended: steps trained \d+, final loss \d\S*, run log "
                        r"\S+\.runlog \(`gpuwatch runs --all`\)", last), last

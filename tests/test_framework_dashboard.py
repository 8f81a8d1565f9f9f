"""The dashboard on real framework runs: the Lightning and Hugging Face examples, each
attached in one line, show live records and take a key press that changes the run."""

import subprocess
import sys
from pathlib import Path

import pytest

from agent.wire import runs
from gpuwatch.app import GpuwatchApp
from gpuwatch.sources.live import LiveSource
from tests.conftest import knows, log_texts, text_of, until

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script", ["lightning_attach.py",
                                    pytest.param("hf_attach.py", marks=pytest.mark.slow)])
@pytest.mark.slow
async def test_framework_run_shows_live_in_the_dashboard_and_takes_a_key(script, run_dir):
    process = subprocess.Popen([sys.executable, str(EXAMPLES / script)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = process.stdout.readline()  # printed once the agent's run file is written
        assert "watch it with `gpuwatch`" in line, line
        info = runs.find_run(line.split()[1].rstrip(":"))
        app = GpuwatchApp(LiveSource(info))
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: "● live" in text_of(app, "#header"), 60)
            await until(pilot, lambda: knows(app, "accum_steps"), 60)
            with app.source.lock:
                first = app.source.state.step
            await until(pilot, lambda: app.source.state.step > first + 5, 60)
            with app.source.lock:
                record = app.source.state.last_step
            assert record["loss"] is not None and record["samples"] > 0
            await pilot.press("A", "A")  # accum_steps + 1 (asked, then sent)
            await until(pilot, lambda: any(t.startswith("accum_steps=2 applied at step")
                                           for t in log_texts(app)), 60)
            await until(pilot, lambda: app.source.state.last_step["micro_batches"] == 2, 60)
    finally:
        process.terminate()
        process.wait(60)

"""The whole run in a dashboard opened late: the run's log read from step 1 in a thread
(:mod:`gpuwatch.sources.whole_run`), drawn thinned with its spikes, then live; ``z``
zooms between it and the steps received; the step-time axis has units and an outlier
never sets its scale."""

from __future__ import annotations

import math
import time

import torch

import agent
from agent.wire import protocol, runs
from agent.step.record import StepRecord
from agent.wire.runlog import RunLog, log_dir
from gpuwatch import history
from gpuwatch.app import GpuwatchApp
from gpuwatch.sources.live import LiveSource
from gpuwatch.sources.timeline import TimelineSource
from gpuwatch.sources.whole_run import WholeRun
from gpuwatch.state import KnobChange
from gpuwatch.widgets.panel import robust_top
from tests.conftest import text_of
from tests.test_dashboard import until
from tests.test_snapshots import screen_text

#: Steps per batch written (the wire's limit is 1,024).
BATCH = 1000
#: The compile: step 1 takes this long (s); the others 10 ms, step 50,000 a spike.
COMPILE_S, STEP_S, SPIKE_STEP, SPIKE_S = 30.0, 0.010, 50_000, 0.5


def step_time_s(step: int) -> float:
    """The step time of ``step`` in the logs written here (s)."""
    return COMPILE_S if step == 1 else SPIKE_S if step == SPIKE_STEP else STEP_S


def samples_per_s(step: int) -> float:
    """The throughput of ``step`` in the logs written here (32 samples a step)."""
    return 32 / step_time_s(step)


def loss(step: int) -> float:
    return 2.0 + 8.0 / math.sqrt(step)


def write_log(path, last_step: int, *, run: str, change_at: int | None = None) -> None:
    """Steps 1..``last_step`` of a run (:func:`step_time_s`, :func:`loss`), written
    with the agent's own :class:`RunLog` in batches as the agent sends them; from
    ``change_at`` on, ``num_workers`` is 2 (else 0)."""
    log = RunLog(path, flush_interval_s=0.0)
    log.write(protocol.envelope("hello", {"name": "late", "device": "cpu",
                                          "world_size": 1, "knobs": []},
                                run=run, seq=1, t=1000.0))
    for seq, first in enumerate(range(1, last_step + 1, BATCH), start=2):
        steps = list(range(first, min(first + BATCH, last_step + 1)))
        workers = [2 if change_at is not None and s >= change_at else 0 for s in steps]
        columns = {"step": steps, "step_time_s": [step_time_s(s) for s in steps],
                   "data_wait_s": [0.001] * len(steps), "loss": [loss(s) for s in steps],
                   "samples_per_s": [samples_per_s(s) for s in steps]}
        common: dict = {}
        if len(set(workers)) == 1:
            common["knobs"] = {"num_workers": workers[0]}
        else:
            columns["knobs"] = [{"num_workers": w} for w in workers]
        log.write(protocol.envelope("steps", protocol.steps_body(columns, common),
                                    run=run, seq=seq, t=1000.0 + first * STEP_S))
    log.close()


def test_the_whole_run_is_read_in_buckets_with_its_spikes(tmp_path):
    """The log read from step 1 in the thread: every step counted once, the buckets'
    ends the first and last steps, the compile and the spike kept as maxima, the
    smallest loss the last step's (bit-exact: the same float64 arithmetic), the knob
    change where it was; what is appended later is read too."""
    path = tmp_path / "whole.rank0.runlog"
    write_log(path, 30_000, run="whole", change_at=20_001)
    whole = WholeRun(str(path))
    whole.start()
    try:
        assert whole.loaded.wait(30)
        past = whole.past
        assert past is not None and past.loaded and past.rows == 30_000
        times = past.series["step_time_s"]
        assert times.first_steps[0] == 1 and times.last_steps[-1] == 30_000
        assert times.highs.max() == COMPILE_S and times.highs[0] == COMPILE_S
        assert times.lows.min() == STEP_S
        assert (times.last_steps[:-1] < times.first_steps[1:]).all()  # in order, apart
        assert past.series["loss"].lows.min() == loss(30_000)
        assert past.knob_changes == (KnobChange(20_001, 1000.0 + 20_001 * STEP_S,
                                                "num_workers", 0, 2),)
        # the run goes on: 30,001..60,000 appended (the spike at 50,000 among them)
        appended = tmp_path / "more.rank0.runlog"
        write_log(appended, 60_000, run="whole")
        more = [envelope for _, envelope in history.LogReader(history.log_at(appended))
                if envelope["type"] == "steps" and envelope["body"]["columns"]["step"][0]
                > 30_000]
        log = RunLog(path, flush_interval_s=0.0)
        for envelope in more:
            log.write(envelope)
        log.close()
        deadline = time.monotonic() + 30
        while (whole.past is None or whole.past.rows < 60_000) and \
                time.monotonic() < deadline:
            time.sleep(0.05)  # (the thread reads again every FOLLOW_S: no event to await)
        times = whole.past.series["step_time_s"]
        assert whole.past.rows == 60_000 and times.last_steps[-1] == 60_000
        spike = times.highs[(times.first_steps <= SPIKE_STEP)
                            & (times.last_steps >= SPIKE_STEP)]
        assert list(spike) == [SPIKE_S]
    finally:
        whole.close()


def test_a_compile_among_the_first_steps_never_sets_the_scale():
    """With 2 to 19 values the scale ends at 4x the median of all but the largest (the
    lower middle one): a 224 s compile over 8 s steps is beyond it, even beside a slow
    second step or as one of two steps; three steps alike have no outlier."""
    assert robust_top([224.0, 8.0, 8.1]) == 8.0 * 4
    assert robust_top([8.0, 8.2, 8.1]) is None
    assert robust_top([224.0, 8.0]) == 8.0 * 4  # the first step compiled: off scale
    assert robust_top([8.23, 2.1, 1.5]) == 1.5 * 4  # a slow second step: still
    assert robust_top([1.5, 1.6, 1.5, 1.7]) is None


def _timing_lines(app) -> list[str]:
    """The screen's rows of the step-time chart (the left half of the charts)."""
    chart = app.query_one("#timing")
    region = chart.region
    rows = screen_text(app).splitlines()[region.y:region.y + region.height]
    return [row[region.x:region.x + region.width] for row in rows]


async def test_a_dashboard_opened_at_step_100000_draws_the_run_from_step_1(run_dir):
    """A live run at step 100,000 whose log has every step: a dashboard opened then
    draws steps 1..100,000 (the log's, thinned, then the live ones), the compile at
    step 1 marked, not setting the scale; ``z`` zooms to the steps received and back.
    The live steps never wait for the log's reading."""
    run_id = "20261202-080000-late"
    live_from = 99_991
    write_log(log_dir() / f"{run_id}.rank0.runlog", live_from - 1, run=run_id)
    monitor = agent.Agent(name="late", run_id=run_id).start()  # appends to that log
    try:
        app = GpuwatchApp(LiveSource(runs.find_run(run_id)), readonly=True)
        async with app.run_test(size=(80, 24)) as pilot:
            opened = time.monotonic()
            await until(pilot, lambda: app.source.state.hello)  # subscribed
            for step in range(live_from, 100_001):
                monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=8,
                                                  data_wait_s=0.001,
                                                  loss=torch.tensor(loss(step))))
            await until(pilot, lambda: app.source.state.steps_total == 10
                        and app.source.whole.past is not None
                        and app.source.whole.past.loaded
                        and "100,000" in "".join(_timing_lines(app)))
            drawn_s = time.monotonic() - opened
            lines = _timing_lines(app)
            axis = lines[-1]
            assert axis.split()[:2] == ["step", "1"] and axis.split()[-1] == "100,000", lines
            # the throughput too: the log's steps, then the 10 received
            spark = text_of(app, "#throughput .spark")
            assert spark.startswith("100,000 steps ") and len(spark.split()[-1]) > 10
            assert "▲" in "".join(lines)  # the compile, marked at the axis' end
            top = next(line for line in lines if "┤" in line).split("┤")[0].strip()
            assert top.endswith(" ms") and float(top.split()[0]) < COMPILE_S * 1e3
            print(f"steps 1..100,000 drawn {drawn_s:.2f} s after opening")

            await pilot.press("z")  # the steps received only
            await until(pilot, lambda: "99,991" in "".join(_timing_lines(app)))
            assert _timing_lines(app)[-1].split()[:2] == ["step", "99,991"]
            await pilot.press("z")  # the whole run again
            await until(pilot, lambda: _timing_lines(app)[-1].split()[:2] == ["step", "1"])
    finally:
        monitor.close()


async def test_a_replay_draws_the_run_from_step_1_up_to_the_step_shown(tmp_path):
    """On a timeline the whole run is the run up to the step shown: from step 1 at the
    end of a 5,000-step log, to step 3,000 after moving back 2,000 steps."""
    path = tmp_path / "replayed.rank0.runlog"
    write_log(path, 5_000, run="replayed")
    app = GpuwatchApp(TimelineSource(history.log_at(path)), readonly=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.source.whole.past is not None
                    and app.source.whole.past.loaded and app.source.index == 4_999
                    and _timing_lines(app)[-1].split()[-1] == "5,000"
                    # (the chart is redrawn with the loaded past a refresh later)
                    and _timing_lines(app)[-1].split()[:2] == ["step", "1"])
        for _ in range(20):
            await pilot.press("shift+left")  # 100 steps back each
        await until(pilot, lambda: _timing_lines(app)[-1].split()[-1] == "3,000")
        assert _timing_lines(app)[-1].split()[:2] == ["step", "1"]

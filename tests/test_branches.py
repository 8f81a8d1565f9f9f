"""A run's branches (the branch contract's ``branched`` event) in every reader: the run
log's tree and paths, ``runs``, ``compare``, ``report``, replay, the runs screen and the
live charts; crafted events read as far as they make sense."""

from __future__ import annotations

import os
import time

import pytest
import torch

import agent
from agent.step.record import StepRecord
from agent.wire import protocol, runlog
from agent.wire.protocol import EventKind
from gpuwatch import history
from gpuwatch.app import GpuwatchApp
from gpuwatch.branches import branch_title, split_selector, tree_lines
from gpuwatch.sources.replay import ReplaySource
from gpuwatch.sources.timeline import TimelineSource
from gpuwatch.state import RunState
from tests.conftest import text_of, until
from tests.test_history import gpuwatch


def _loss(step, branch):
    """The loss a step of a branch trains to (branch 1's differ from branch 0's)."""
    return float(torch.tensor(1.0 / step + 0.01 * branch))


def branched_run(run_dir):
    """A real agent: steps 1-200 on b0, a knob change at 150, a rewind to 120 (the
    contract's event, published in order with the steps), then 121-300 on b1 with
    lr_scale=0.5 applied at 160 (and a pause, an action). Returns the log's path."""
    monitor = agent.Agent(name="branchy").start()

    def train(first, last, branch):
        for step in range(first, last + 1):
            monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=8,
                                              data_wait_s=0.0,
                                              loss=torch.tensor(_loss(step, branch))))
            if step == 150 and branch == 0:
                monitor.event("info", "accum_steps=2 applied at step 151",
                              kind=EventKind.APPLIED, knob="accum_steps", value=2, step=151)
            if step == 160 and branch == 1:
                monitor.event("info", "lr_scale=0.5 applied at step 161",
                              kind=EventKind.APPLIED, knob="lr_scale", value=0.5, step=161)
                monitor.event("info", "pause=on applied at step 161",  # (an action: no
                              kind=EventKind.APPLIED, knob="pause", value="on", step=161)

    train(1, 200, 0)
    monitor.event("info", "rewound to step 120 from /ck/step120.pt", kind=EventKind.BRANCHED,
                  branch=1, parent=0, step=120, source="/ck/step120.pt", cause="rewind=120")
    train(121, 300, 1)
    monitor.close()
    return monitor.info.log_path


def test_the_log_keeps_the_branch_event_before_the_new_branchs_steps(run_dir):
    """The writer keeps records in the order they were published: the ``branched``
    event after b0's step 200, before b1's step 121; the summary beside the log holds
    the tree; each branch's path is its parent's steps up to the fork, then its own,
    with the losses they trained to."""
    path = branched_run(run_dir)
    records = list(history.flat_records(path))
    at = next(index for index, record in enumerate(records)
              if record.get("kind") == EventKind.BRANCHED)
    steps_before = [r["step"] for r in records[:at] if r["type"] == "step"]
    steps_after = [r["step"] for r in records[at:] if r["type"] == "step"]
    assert steps_before == list(range(1, 201)) and steps_after == list(range(121, 301))
    tree = runlog.read_summary(runlog.summary_path(path)).tree
    assert tree.current == 1 and list(tree.branches) == [0, 1]
    b0, b1 = tree.branches[0], tree.branches[1]
    assert (b0.first_step, b0.last_step, b0.steps) == (1, 200, 200)
    assert (b1.parent, b1.fork_step, b1.source, b1.cause) == (0, 120, "/ck/step120.pt",
                                                              "rewind=120")
    assert (b1.first_step, b1.last_step, b1.steps) == (121, 300, 180)
    assert b0.applied == [[151, "accum_steps", 2]] and b1.applied == [[161, "lr_scale", 0.5]]
    log = history.log_at(path)
    for branch, expected in ((1, [(s, 0) for s in range(1, 121)]
                              + [(s, 1) for s in range(121, 301)]),
                             (0, [(s, 0) for s in range(1, 201)])):
        on_path = runlog.BranchPath(tree, branch)
        rows = []
        for _, envelope in history.LogReader(log):
            kept = on_path.keep(envelope)
            if kept is not None and kept["type"] == protocol.STEPS:
                rows += zip(kept["body"]["columns"]["step"], kept["body"]["columns"]["loss"])
        assert rows == [(step, _loss(step, b)) for step, b in expected]
    run = history.read_history(log)  # the branch taken last, by default
    assert run.branch == 1 and run.summary.steps == 300
    assert [(c.step, c.knob) for c in run.knob_changes] == []  # (applied: no knob column)
    assert [e.text.split(" applied")[0] for e in run.events] == [  # b0's at 151: gone
        "rewound to step 120 from /ck/step120.pt", "lr_scale=0.5", "pause=on"]
    assert history.read_history(log, branch=0).summary.steps == 200
    with pytest.raises(ValueError, match="no branch 7"):
        history.read_history(log, branch=7)


def test_runs_compare_and_report_show_the_branches(run_dir):
    """`runs --all` draws the tree under the run (80 columns), `compare RUN` puts the
    branches side by side (each from its fork on), `compare RUN@b0 RUN@b1` their
    paths, and the report marks the fork."""
    path = branched_run(run_dir)
    run_id = history.log_at(path).run_id
    listed = gpuwatch("runs", "--all")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(run_id))
    assert lines[at + 1:at + 3] == [
        "  b0 steps 1-200: accum_steps=2",
        "  └ b1 from step 120 (rewind=120) steps 121-300: lr_scale=0.5  (latest)"]
    assert all(len(line) <= 80 for line in lines[at + 1:at + 3])
    compared = gpuwatch("compare", run_id)
    assert compared.returncode == 0, compared.stderr
    table = compared.stdout.splitlines()
    assert table[0].split() == ["b0", "b1", "from", "step", "120", "(rewind=120)", "ratio"]
    assert table[1].split()[:3] == ["steps", "1-200", "(200)"]
    assert table[1].split()[3:5] == ["121-300", "(180)"]
    paths = gpuwatch("compare", f"{run_id}@b0", f"{run_id}@b1", "--json")
    assert paths.returncode == 0, paths.stderr
    import json
    columns = json.loads(paths.stdout)
    assert [c["title"].split()[0] for c in columns] == [f"{run_id}@b0", f"{run_id}@b1"]
    assert [(c["first_step"], c["last_step"], c["steps"]) for c in columns] == [
        (1, 200, 200), (1, 300, 300)]
    missing = gpuwatch("compare", f"{run_id}@b9")
    assert missing.returncode == 1 and "no branch 9" in missing.stderr
    pytest.importorskip("matplotlib")
    out = os.path.join(run_dir, "report.html")
    reported = gpuwatch("report", run_id, "-o", out)
    assert reported.returncode == 0, reported.stderr
    page = open(out, encoding="utf-8").read()
    assert "<h2>Branches</h2>" in page and "b1: its path" in page
    assert "└ b1 from step 120 (rewind=120) steps 121-300: lr_scale=0.5" in page


def test_a_long_cause_keeps_its_end():
    branch = runlog.Branch(2, 1, 5, cause="rewind=/checkpoints/experiment-42/"
                                          "lr-sweep/step-00000005.pt")
    assert branch_title(branch) == "b2 from step 5 (rewind=/check…lr-sweep/step-00000005.pt)"
    assert branch_title(runlog.Branch(0)) == "b0"


def test_a_long_prose_cause_keeps_its_start_cut_at_a_word():
    """A recovery's cause is a paragraph: its start says what happened; a middle cut
    read "(loss spike: l…13 windows) trained since)"."""
    cause = ("loss spike: loss 1.992 at steps 743-745, above 1.863 (median 1.663 + "
             "margin); restored the state kept after step 733 (4.8 MiB in host memory); "
             "skipped the 26 micro-batches (13 windows) trained since")
    assert branch_title(runlog.Branch(1, 0, 733, cause=cause)) == (
        "b1 from step 733 (loss spike: loss 1.992 at steps 743-745…)")
    assert branch_title(runlog.Branch(1, 0, 7, cause="x" * 60)) == (
        f"b1 from step 7 ({'x' * 39}…)")


def test_a_selector_names_a_branch():
    assert split_selector("20250101-000000-0001@b12") == ("20250101-000000-0001", 12)
    assert split_selector("run@x1") == ("run@x1", None)
    assert split_selector("/logs/a@b.runlog") == ("/logs/a@b.runlog", None)


def _crafted_log(path):
    """A log written by the real writer with ``branched`` events that make no sense:
    a parent that is no branch, a negative step, a huge id, a parent that is a later
    branch (a loop, if believed), a step that is text, a body without fields."""
    log = runlog.RunLog(path, flush_interval_s=0.0)
    seq = 0

    def write(kind, body):
        nonlocal seq
        seq += 1
        log.write(protocol.envelope(kind, body, run="crafted", seq=seq, t=time.time()))

    def steps(first, last):
        columns = {"step": list(range(first, last + 1)),
                   "loss": [1.0] * (last - first + 1)}
        write(protocol.STEPS, protocol.steps_body(columns))

    write(protocol.HELLO, {"name": "crafted"})
    steps(1, 10)
    for body in ({"branch": 1, "parent": 99, "step": 5}, {"branch": 2, "step": -3},
                 {"branch": 10 ** 30, "parent": 1, "step": 7},
                 {"branch": 5, "parent": 6, "step": 2}, {"branch": 6, "parent": 5},
                 {"branch": 1, "step": "x"}, {}, {"branch": -1, "parent": None,
                                                  "step": 1 << 80, "cause": "\x1b[2J"}):
        write(protocol.EVENT, {"level": "info", "kind": EventKind.BRANCHED, "text": "?",
                               **body})
        steps(11, 12)
    log.close()
    return path


def test_crafted_branch_events_are_read_as_far_as_they_make_sense(tmp_path):
    path = _crafted_log(tmp_path / "crafted.rank0.runlog")
    tree = runlog.read_summary(runlog.summary_path(path)).tree
    branches = tree.branches
    assert list(branches) == [0, 1, 2, 3, 5, 6, 7, 8, 9]  # every id new and whole
    assert branches[1].parent == 0  # (99: no branch; the records were on b0)
    assert branches[2].fork_step == 12  # (-3: no step; its parent's latest)
    assert branches[3].parent == 1 and branches[3].fork_step == 7  # (10**30: the next id)
    assert branches[5].parent == 3  # (6: not a branch yet: no loop)
    assert branches[6].parent == 5 and branches[6].fork_step == 12
    assert "\x1b" not in branches[9].cause
    for branch in branches.values():  # every path ends at b0, no loop
        assert 0 in tree.path(branch.branch)
    lines = tree_lines(tree)
    assert len(lines) == len(branches) and all("\x1b" not in line for line in lines)
    log = history.log_at(path)
    for branch in branches:
        assert history.read_history(log, branch=branch).summary.steps >= 2
    state = RunState()
    for _, envelope in history.LogReader(log):
        state.ingest(envelope)
    assert state.malformed == 0 and state.tree.current == 9
    on_path = runlog.BranchPath(tree)  # the live fold and the path reader agree
    path_steps = []
    for _, envelope in history.LogReader(log):
        kept = on_path.keep(envelope)
        if kept is not None and kept["type"] == protocol.STEPS:
            path_steps += kept["body"]["columns"]["step"]
    assert [record.step for record in state.steps] == path_steps == [1, 2] + [11, 12] * 5
    assert runlog.LogSummary.from_json(runlog.LogSummary().to_json()).tree.current == 0
    assert runlog.BranchTree.from_public({"branches": [{"branch": 1, "parent": 1}],
                                          "current": 1, "omitted": 0}) is None


def test_past_the_bound_branches_are_counted_not_kept():
    tree = runlog.BranchTree()
    for _ in range(runlog.MAX_BRANCHES + 5):
        tree.stepped(1, 1, 1)
        tree.branched({"step": 0})
    assert len(tree) == runlog.MAX_BRANCHES and tree.omitted == 6
    assert tree_lines(tree)[-1] == f"… {runlog.MAX_BRANCHES - 39 + 6:,} more branches"
    assert len(runlog.LogSummary(tree=tree).to_json()) <= runlog.MAX_SUMMARY_BYTES


async def test_the_charts_follow_a_new_branch_and_the_log_says_so(run_dir):
    """A replay of a branched run: the charts hold the parent's steps up to the fork,
    then the new branch's (no step twice, never back in x), the log says the run
    went on as b1; --branch 0 plays b0's path."""
    path = branched_run(run_dir)
    app = GpuwatchApp(ReplaySource(path, follow=False), readonly=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "● ended" in text_of(app, "#header"))
        with app.source.lock:
            steps = [record.step for record in app.source.state.steps]
        assert steps == list(range(1, 301))[-len(steps):] and len(steps) >= 180
        log_text = "\n".join(str(line.text) for line in app.query_one("#log").lines)
        assert "now on branch b1, from step 120 of b0" in log_text
    tree = history.log_summary(history.log_at(path))[0].tree
    app = GpuwatchApp(ReplaySource(path, follow=False, branch=(tree, 0)), readonly=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "● ended" in text_of(app, "#header"))
        with app.source.lock:
            assert app.source.state.steps[-1].step == 200
            assert app.source.state.tree.current == 0


async def test_the_runs_screen_draws_the_branches_of_the_run_under_the_cursor(run_dir):
    path = branched_run(run_dir)
    app = GpuwatchApp(TimelineSource(history.log_at(path)), readonly=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "step" in text_of(app, "#timeline"))
        await pilot.press("r")
        table = app.screen.query_one("#runs-table")
        await until(pilot, lambda: table.row_count == 1)
        assert table.get_row_at(0)[8] == "2"
        await until(pilot, lambda: "b1 from step 120" in str(
            app.screen.query_one("#runs-branches").content))
        shown = str(app.screen.query_one("#runs-branches").content).splitlines()
        assert shown == ["b0 steps 1-200: accum_steps=2",
                         "└ b1 from step 120 (rewind=120) steps 121-300: lr_scale=0.5  "
                         "(latest)"]


async def test_a_finished_branched_run_plays_on_a_timeline_along_one_path(run_dir):
    """`gpuwatch RUN` / replay of a finished run: the timeline is the path of the
    branch taken last (steps 1-120 of b0, then 121-300 of b1: 300 positions, each
    step once), its whole-run view too; `--branch 0` plays b0's."""
    path = branched_run(run_dir)
    log = history.log_at(path)
    source = TimelineSource(log)
    app = GpuwatchApp(source, readonly=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "step 300 of 300" in text_of(app, "#timeline"))
        timeline = source.timeline
        assert list(timeline.steps) == list(range(1, 301))
        state, _ = timeline.state_at(150)  # b1's step 151, its loss, not b0's
        assert state.steps[-1].step == 151 and state.steps[-1].loss == _loss(151, 1)
        state, _ = timeline.state_at(60)
        assert state.steps[-1].loss == _loss(61, 0)
        # the other branch's records were left out, not lost: no "missed" anywhere
        assert timeline.state_at(299)[0].missed == 0 and timeline.state_at(150)[0].missed == 0
        assert "missed" not in text_of(app, "#header")
        await until(pilot, lambda: source.whole.past is not None and source.whole.past.loaded)
        series = source.whole.past.series["loss"]
        assert list(series.first_steps) == list(range(1, 301))
        assert series.means[-1] == _loss(300, 1) and series.means[119] == _loss(120, 0)
    tree = history.log_summary(log)[0].tree
    source = TimelineSource(log, branch=(tree, 0))
    app = GpuwatchApp(source, readonly=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: "step 200 of 200" in text_of(app, "#timeline"))
        assert source.timeline.state_at(199)[0].missed == 0
        assert "missed" not in text_of(app, "#header")
        await until(pilot, lambda: source.whole.past is not None and source.whole.past.loaded)
        assert source.whole.past.series["loss"].last_steps[-1] == 200


def test_the_whole_run_view_follows_the_branch_being_trained(run_dir):
    """Read as it was written (a live run's log), the whole-run view goes back to the
    fork at the branched event: its buckets and knob changes are the new branch's
    path, never back in x."""
    from gpuwatch.sources.whole_run import WholeRun

    path = branched_run(run_dir)
    whole = WholeRun(path)
    whole.start()
    try:
        assert whole.loaded.wait(60)  # (set once the whole log is read and published)
    finally:
        whole.close()
    series = whole.past.series["loss"]
    assert list(series.first_steps) == list(range(1, 301))
    assert series.means[125] == _loss(126, 1)


async def test_the_live_dashboard_goes_on_along_the_new_branch(run_dir):
    """A live run (real agent, real ZeroMQ) that rewinds: the dashboard's charts hold
    b0's steps up to the fork, then b1's (each step once, in order), the log says the
    run went on as b1, and the chart draws up to step 300."""
    from agent.wire import runs
    from gpuwatch.sources.live import LiveSource

    monitor = agent.Agent(name="rewinding").start()
    app = GpuwatchApp(LiveSource(runs.find_run(monitor.run_id)), readonly=True)

    def train(first, last, branch):
        for step in range(first, last + 1):
            monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=8,
                                              data_wait_s=0.0,
                                              loss=torch.tensor(_loss(step, branch))))

    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.source.state.hello)  # subscribed
            train(1, 200, 0)
            await until(pilot, lambda: app.source.state.steps_total == 200, timeout_s=60)
            monitor.event("info", "rewound to step 120", kind=EventKind.BRANCHED, branch=1,
                          parent=0, step=120, source="/ck/step120.pt", cause="rewind=120")
            train(121, 300, 1)
            await until(pilot, lambda: app.source.state.steps_total == 380, timeout_s=60)
            await until(pilot, lambda: "step 300 " in text_of(app, "#header"))
            with app.source.lock:
                state = app.source.state
                steps = [record.step for record in state.steps]
                assert steps == list(range(1, 301))[-len(steps):] and len(steps) >= 180
                assert state.steps[-1].loss == _loss(300, 1) and state.tree.current == 1
            log_text = "\n".join(str(line.text) for line in app.query_one("#log").lines)
            assert "rewound to step 120" in log_text
            assert "now on branch b1, from step 120 of b0" in log_text
    finally:
        monitor.close()


def test_a_real_rewound_run_reads_as_its_tree_and_paths(run_dir, tmp_path):
    """With ``rewind=`` (A1's, tests/test_rewind.py; skipped until it is merged): a
    checkpoint after step 3, rewind=3 after step 6, a checkpoint after step 5 of b1, a
    rewind by its path after step 7. The tree is b0 1-6, b1 from 3: 4-7, b2 from 5:
    6-7, with no change listed (the rewinds are commands, not settings); b2's path
    has each step's loss as logged on its branch, and the live fold draws the same."""
    rewind = pytest.importorskip("tests.test_rewind", reason="rewind= is not merged yet")
    loop = rewind.Loop(tmp_path)
    loop.train(2)
    assert loop.send("checkpoint", "now")["ok"]
    loop.train(3)
    assert loop.send("rewind", "3")["ok"]
    loop.train(2)
    assert loop.send("checkpoint", "now")["ok"]
    loop.train(2)
    assert loop.send("rewind", str(tmp_path / "step-00000005.pt"))["ok"]
    loop.train(3)
    path = loop.run.agent.info.log_path
    records = loop.records()
    losses, branch = {}, 0
    for record in records:
        if record["type"] == "event" and record.get("kind") == EventKind.BRANCHED:
            branch = record["branch"]
        elif record["type"] == "step":
            losses[(branch, record["step"])] = record["loss"]
    log = history.log_at(path)
    tree = history.log_summary(log)[0].tree
    assert [(b.branch, b.parent, b.fork_step, b.first_step, b.last_step, b.applied)
            for b in tree.branches.values()] == [
        (0, None, None, 1, 6, []), (1, 0, 3, 4, 7, []), (2, 1, 5, 6, 7, [])]
    want = [(0, 1), (0, 2), (0, 3), (1, 4), (1, 5), (2, 6), (2, 7)]
    on_path = runlog.BranchPath(tree)
    got = []
    for _, envelope in history.LogReader(log):
        kept = on_path.keep(envelope)
        if kept is not None and kept["type"] == protocol.STEPS:
            got += zip(kept["body"]["columns"]["step"], kept["body"]["columns"]["loss"])
    assert got == [(step, losses[(b, step)]) for b, step in want]
    state = RunState()
    for _, envelope in history.LogReader(log):
        state.ingest(envelope)
    assert [(r.step, r.loss) for r in state.steps] == got
    assert tree_lines(tree)[2].endswith("step-00000005.pt) steps 6-7  (latest)")


@pytest.mark.slow
def test_a_log_of_many_branches_is_read_in_bounded_memory(tmp_path):
    """42,000 steps over 1,050 branches (each rewinds 10 steps and trains 40): the
    tree keeps 1,000 and counts the rest, and reading a path, the branches side by
    side and the runs' summary holds a few MiB whatever the log's length."""
    import tracemalloc

    path = tmp_path / "many.rank0.runlog"
    log = runlog.RunLog(path, flush_interval_s=0.0)
    seq, step = 0, 0

    def write(kind, body):
        nonlocal seq
        seq += 1
        log.write(protocol.envelope(kind, body, run="many", seq=seq, t=1.0e9 + seq))

    write(protocol.HELLO, {"name": "many"})
    for branch in range(1, 1051):
        columns = {"step": list(range(step + 1, step + 41)), "loss": [1.0 / branch] * 40,
                   "step_time_s": [0.1] * 40, "knobs": [{"lr_scale": branch}] * 40}
        write(protocol.STEPS, protocol.steps_body(columns))
        step += 40 - 10
        write(protocol.EVENT, {"level": "info", "kind": EventKind.BRANCHED, "branch": branch,
                               "parent": branch - 1, "step": step, "source": "rollback",
                               "cause": f"rewind={step}", "text": "back"})
    log.close()
    files = history.log_at(path)
    tracemalloc.start()
    try:
        run = history.read_history(files)
        segments = history.branch_segments(files, run.tree)
        summaries = history.summarize_logs([files])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(run.tree) == runlog.MAX_BRANCHES and run.tree.omitted == 51
    assert run.branch == 999 and len(segments) == history.MAX_COMPARED_BRANCHES
    assert summaries[0].tree.omitted == 51
    assert peak < 32 << 20, f"{peak / 2**20:.1f} MiB"


@pytest.mark.slow
def test_runs_draws_a_live_runs_branches(run_dir):
    """`gpuwatch runs` (the live runs) draws the tree of a run that is still training,
    from its log as written so far."""
    from tests.conftest import wait_until

    monitor = agent.Agent(name="live-branches").start()
    try:
        for step in range(1, 11):
            monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=8,
                                              data_wait_s=0.0))
        monitor.event("info", "rolled back to step 6", kind=EventKind.BRANCHED, branch=1,
                      parent=0, step=6, source="rollback", cause="out of memory")
        for step in range(7, 9):
            monitor.optimizer_step(StepRecord(step=step, micro_batches=1, samples=8,
                                              data_wait_s=0.0))
        log = history.log_at(monitor.info.log_path)

        def written():
            branch = history.log_summary(log, live=True)[0].tree.branches.get(1)
            return branch is not None and branch.last_step == 8

        wait_until(written, "the log to hold b1's steps")
        listed = gpuwatch("runs")
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith(monitor.run_id))
        assert lines[at + 1:at + 3] == [
            "  b0 steps 1-10", "  └ b1 from step 6 (out of memory) steps 7-8  (latest)"]
    finally:
        monitor.close()

"""The ``gpuwatch`` command line as real subprocesses against a fake agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.wire import runs


def gpuwatch(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "gpuwatch", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_runs_json_lists_public_fields(fake_agent):
    result = gpuwatch("runs", "--json")
    assert result.returncode == 0, result.stderr
    [run] = json.loads(result.stdout)
    assert run["run_id"] == fake_agent.info.run_id
    assert run["pub_endpoint"] == fake_agent.info.pub_endpoint
    assert "token" not in run and "path" not in run


def test_runs_table(fake_agent):
    result = gpuwatch("runs")
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()
    assert header.split() == ["RUN", "RANK", "PID", "NAME", "AGE", "ENDPOINT"]
    assert row.split()[:4] == [fake_agent.info.run_id, "0/1", str(fake_agent.info.pid),
                               "fake-train"]


def test_set_accepted(make_agent):
    fake_agent = make_agent(knobs={"precision": "fp32", "accum_steps": 1, "checkpoint": "now"})
    result = gpuwatch("set", "accum_steps=4", "--run", fake_agent.info.run_id[:18])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("accepted: accum_steps=4 applies at step ")
    assert fake_agent.commands.get(timeout=5)["value"] == "4"  # sent raw, parsed by the agent
    result = gpuwatch("set", "precision=fp16", "--checkpoint")  # a checkpoint first
    assert result.returncode == 0, result.stderr
    command = fake_agent.commands.get(timeout=5)
    assert (command["knob"], command["checkpoint"]) == ("precision", True)


def test_set_without_run_names_the_run_it_sends_to_when_there_are_several(make_agent):
    """Plain ``gpuwatch set`` goes to the newest live run: with several, it says which
    (on stderr, before sending), so a person sees whose job it changed."""
    older = make_agent(knobs={"accum_steps": 1}, run_id="20250101-000000-aaaa")
    newer = make_agent(knobs={"accum_steps": 1}, run_id="20250101-000001-bbbb")
    result = gpuwatch("set", "accum_steps=4")
    assert result.returncode == 0, result.stderr
    newest = runs.find_run()  # what plain `set` picks
    assert newest.run_id in (older.info.run_id, newer.info.run_id)
    assert f"to run {newest.run_id}" in result.stderr
    assert "the newest of 2 live runs (--run RUN picks another)" in result.stderr
    alone = gpuwatch("set", "accum_steps=2", "--run", older.info.run_id)
    assert alone.returncode == 0 and "newest" not in alone.stderr


def test_the_newest_run_is_named_when_other_runs_are_live(make_agent):
    """Plain ``gpuwatch`` opens the newest live run: with several, its event log starts
    with which one it is and how to open another (a newcomer opened another job's run
    and could not tell); alone, nothing is said."""
    from gpuwatch.cli import _newest_of

    older = make_agent(knobs={"accum_steps": 1}, run_id="20250101-000000-aaaa")
    assert _newest_of(older.info) is None
    make_agent(knobs={"accum_steps": 1}, run_id="20250101-000001-bbbb")
    newest = runs.find_run()
    assert _newest_of(newest) == (f"run {newest.run_id} ({newest.name}), the newest of "
                                  "2 live runs")


@pytest.mark.parametrize("assignment, reason", [
    ("precision=fp64", "precision: 'fp64' is not one of fp32, bf16, fp16"),
    ("kernels=triton", "unknown knob 'kernels'"),
])
def test_set_rejected(fake_agent, assignment, reason):
    result = gpuwatch("set", assignment)
    assert result.returncode == 1
    assert result.stderr.startswith("rejected: ") and reason in result.stderr


@pytest.mark.parametrize("command", [("tail",), ("set", "lr_scale=0.5"), ("nodes",)])
def test_without_a_run_each_command_says_how_to_start_one(run_dir, command):
    result = gpuwatch(*command)
    assert result.returncode == 1
    assert result.stderr == (
        f"gpuwatch: no live run found (run files in {run_dir}).\nStart one:\n"
        "  gpuwatch demo                 a small training job, with the dashboard on it\n"
        "  agent.attach(trainer)         in your own training script\n")


def test_demo_resume_of_a_missing_checkpoint_is_one_clear_line(tmp_path):
    result = gpuwatch("demo", "--resume", str(tmp_path / "nothing.pt"))
    assert result.returncode == 2
    assert result.stderr.startswith(f"gpuwatch demo: no checkpoint at {tmp_path}")
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_demo_on_a_device_this_machine_lacks_says_so_in_one_line(run_dir):
    result = gpuwatch("demo", "--no-ui", "--device", "cuda", "--max-steps", "1")
    assert result.returncode == 1
    why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
           else "torch sees 0 CUDA devices here")
    assert f"python -m agent.demo: --device cuda: {why}\n" in result.stderr
    assert result.stderr.endswith("gpuwatch demo: the training job exited with status 2\n")
    assert "usage:" not in result.stderr and "Traceback" not in result.stderr
    assert not list(Path(run_dir).glob("*.json"))  # no run was started


def test_set_needs_an_assignment(fake_agent):
    result = gpuwatch("set", "precision")
    assert result.returncode == 2 and "KNOB=VALUE" in result.stderr
    assert fake_agent.commands.empty()


def test_tail_json_count(fake_agent):
    result = gpuwatch("tail", "--json", "--count", "5")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 5
    for record in records:
        assert record["run"] == fake_agent.info.run_id
        assert {"type", "rank", "seq", "t"} <= record.keys()
    step = next(r for r in records if r["type"] == "step")
    assert {"step", "step_time_s", "loss", "knobs"} <= step.keys()


def test_tail_human_lines(fake_agent):
    result = gpuwatch("tail", "--count", "3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert any(line.startswith("step ") and "samples/s" in line and "precision=fp32" in line
               for line in lines)


@pytest.mark.parametrize("args", [(), ("set", "precision=bf16"), ("tail",)])
def test_no_live_run_says_how_to_start_one(run_dir, args):
    result = gpuwatch(*args)
    assert result.returncode == 1
    assert "no live run" in result.stderr and "gpuwatch demo" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_run_selector(fake_agent):
    result = gpuwatch("nosuchrun")
    assert result.returncode == 1 and "no live run matches 'nosuchrun'" in result.stderr
    assert "did you mean" not in result.stderr
    assert "the commands: `gpuwatch --help`" in result.stderr  # (a word, not a run id)
    assert "--help" not in gpuwatch("19990101").stderr


@pytest.mark.parametrize("selector, meant", [
    ("checkpoint", "gpuwatch set checkpoint=now"),
    ("precision=bf16", "gpuwatch set precision=bf16"), ("lr_scale", "gpuwatch set lr_scale=VALUE"),
    ("dropout=\x1b[2J", "gpuwatch set dropout=\u241b[2J")])
def test_a_knob_given_as_a_run_is_told_the_set_command(run_dir, selector, meant):
    # a newcomer typed `gpuwatch checkpoint` and read "no live run matches 'checkpoint'"
    result = gpuwatch(selector)
    assert result.returncode == 1
    assert result.stderr.rstrip().endswith(f"a knob: did you mean `{meant}`?"), result.stderr


@pytest.mark.parametrize("content", [
    '{"run_id": "zzz", "pid": "abc", "rank": 0, "world_size": 1, "pub_endpoint": "x",'
    ' "cmd_endpoint": "", "token": "t", "started_at": 1.0}',
    '{"run_id": "zzz", "pid": 99999999999999999999, "rank": 0, "world_size": 1,'
    ' "pub_endpoint": "x", "cmd_endpoint": "", "token": "t", "started_at": 1.0}',
    '{"run_id": "zzz", "pid": -1, "rank": 0, "world_size": 1, "pub_endpoint": "x",'
    ' "cmd_endpoint": "", "token": "t", "started_at": 1.0}',
    '{"run_id": 123, "pid": 0, "rank": null}', "[" * 100_000, "not json", "[1, 2]",
])
def test_malformed_or_foreign_run_files_are_skipped(fake_agent, run_dir, content):
    (Path(run_dir) / "zzz.rank0.json").write_text(content)
    result = gpuwatch("runs", "--json")
    assert result.returncode == 0, result.stderr
    assert [r["run_id"] for r in json.loads(result.stdout)] == [fake_agent.info.run_id]


def test_tail_of_a_bad_endpoint_says_so(run_dir):
    result = gpuwatch("tail", "--run", "tcp://nonsense")
    assert result.returncode == 1 and "cannot subscribe" in result.stderr
    assert "Traceback" not in result.stderr


def test_tail_of_a_finished_run_by_id_prints_its_log(run_dir):
    """A run that is no longer live is named by its id as `gpuwatch RUN`, `report` and
    `export` name it: `tail` prints its log, as `tail FILE` does, not "no live run"."""
    from tests.test_history import write_run
    from tests.test_replay import RUN

    logs = Path(run_dir) / "logs"
    logs.mkdir(exist_ok=True)
    path = logs / f"{RUN}.rank0.runlog"
    write_run(path, steps=40)
    by_file = gpuwatch("tail", "--json", str(path))
    assert by_file.returncode == 0, by_file.stderr
    steps = [json.loads(line)["step"] for line in by_file.stdout.splitlines()
             if json.loads(line)["type"] == "step"]
    assert steps == list(range(1, 41))
    for args in ((RUN,), ("--run", RUN[:18])):
        by_id = gpuwatch("tail", "--json", *args)
        assert by_id.returncode == 0, by_id.stderr
        assert by_id.stdout == by_file.stdout
    unknown = gpuwatch("tail", "20990101-000000-dead")
    assert unknown.returncode == 1 and "no live run matches" in unknown.stderr


def test_tail_last_prints_a_logs_last_records_as_tail_n(run_dir):
    """`tail --last N` of an ended run (by id or file) prints the last N records of its
    log, as `tail -n` does: the same lines as the whole log's last N, in JSON and for
    people; N < 1 is refused."""
    from tests.test_history import write_run
    from tests.test_replay import RUN

    logs = Path(run_dir) / "logs"
    logs.mkdir(exist_ok=True)
    path = logs / f"{RUN}.rank0.runlog"
    write_run(path, steps=40)
    for as_json in ((), ("--json",)):
        whole = gpuwatch("tail", *as_json, str(path)).stdout.splitlines()
        for target in (str(path), RUN):
            last = gpuwatch("tail", *as_json, "--last", "3", target)
            assert last.returncode == 0, last.stderr
            assert last.stdout.splitlines() == whole[-3:], last.stdout
    assert [json.loads(line)["type"] for line in whole[-3:]] == ["step", "heartbeat", "bye"]
    assert json.loads(whole[-3])["step"] == 40
    assert gpuwatch("tail", "-n", "100", str(path), "--json").stdout.splitlines() == whole[-100:]
    refused = gpuwatch("tail", "--last", "0", RUN)
    assert refused.returncode == 2 and "--last N needs N >= 1" in refused.stderr


def test_tail_last_of_a_live_run_prints_its_logs_end_then_follows_to_its_bye(run_dir):
    """`tail --last 2 RUN` of a live run: the last 2 records its log holds, then what the
    run logs after, until its bye (the steps trained after the tail started included)."""
    import agent
    from gpuwatch.history import flat_records
    from tests.training import digits_loader, model as make_model

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = digits_loader(batch_size=8)
    with agent.session(model=model, optimizer=optimizer, name="tail-last") as run:
        log_path = run.agent.info.log_path

        def train(steps):
            for x, y in data[:steps]:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                run.optimizer_step(loss)

        train(50)
        logged = []
        while not any(r.get("step") == 50 for r in logged):  # (the writer's next frame)
            logged = [r for r in flat_records(log_path) if r["type"] == "step"]
        tail = subprocess.Popen([sys.executable, "-m", "gpuwatch", "tail", "--json", "--last",
                                 "2", run.agent.run_id], stdout=subprocess.PIPE, text=True)
        first = json.loads(tail.stdout.readline())  # (what the log held: it is running)
        train(10)
    out, _ = tail.communicate(timeout=30)
    records = [first, *map(json.loads, out.splitlines())]
    assert tail.returncode == 0
    assert records[-1]["type"] == "bye"
    steps = [r["step"] for r in records if r["type"] == "step"]
    assert 1 not in steps and steps[-1] == 60 and steps == sorted(steps)
    assert len(records) < 40  # (not the log from its start)


def test_tail_of_a_fifo_says_it_is_not_a_run_log_and_never_opens_it(run_dir, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it to read would wait for a writer: a hang
    for target in (fifo, tmp_path):
        result = gpuwatch("tail", str(target), timeout=20)
        kind = "a FIFO" if target == fifo else "a directory"
        assert result.returncode == 1, result.stderr
        assert result.stderr == f"gpuwatch tail: {target} is {kind}, not a run log file\n"


def test_a_copied_log_is_listed_under_its_runs_id_with_its_path(run_dir):
    from tests.test_history import write_run
    from tests.test_replay import RUN

    logs = Path(run_dir) / "logs"
    logs.mkdir(exist_ok=True)
    copy = logs / "backup.rank0.runlog"  # the copy's name names no run
    write_run(copy, steps=12)
    [listed] = json.loads(gpuwatch("runs", "--all", "--json").stdout)
    assert (listed["run_id"], listed["name"]) == (RUN, "replayed")  # as its records say
    assert listed["log_path"] == str(copy) and listed["steps"] == 12
    table = gpuwatch("runs", "--all").stdout.splitlines()
    assert table[1].startswith(RUN) and table[1].endswith(f"finished, log {copy}")
    assert "backup" not in table[1].split()[0]


def test_tail_of_odd_records_prints_them_raw(tmp_path):
    log = tmp_path / "odd.jsonl"
    log.write_text('{"type":"step","step":1,"knobs":[1,2],"loss":"x"}\n'
                   '{"type":"step","step":2,"big":' + "9" * 30 + "}\n"
                   + "[" * 10_000 + "\n")
    for flags in ((), ("--json",)):
        result = gpuwatch("tail", *flags, str(log))
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr
        assert result.stdout.count("\n") == 2


@pytest.mark.parametrize("command", ["demo", "set", "tail", "replay", "runs", "doctor"])
def test_each_command_help_names_itself(command):
    result = gpuwatch(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: gpuwatch {command} [-h]"), result.stdout


def test_every_option_of_every_command_says_what_it_does():
    """`gpuwatch demo --help` listed --model {transformer,cnn} with no word on either."""
    import argparse

    from gpuwatch.cli import _parser

    [commands] = [action for action in _parser()._actions
                  if isinstance(action, argparse._SubParsersAction)]
    for name, parser in commands.choices.items():
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, (name, action.option_strings or action.dest)


def test_the_top_help_points_to_the_dashboards_options():
    result = gpuwatch("--help")
    assert result.returncode == 0 and "[--readonly] [--quick-keys]" in result.stdout
    assert "gpuwatch attach --help" in " ".join(result.stdout.split())  # (wrapped)


def test_version():
    result = gpuwatch("--version")
    assert result.returncode == 0 and result.stdout.startswith("gpuwatch ")


@pytest.mark.parametrize("command", ["attach", "set", "tail", "report", "compare",
                                     "export"])
def test_every_command_that_takes_a_run_takes_dash_dash_run(command):
    result = gpuwatch(command, "--help")
    assert result.returncode == 0 and "--run RUN" in result.stdout, result.stdout


def test_dash_dash_run_names_the_run_of_the_dashboard_and_the_history_commands(run_dir):
    for args in (["--run", "nonesuch"], ["attach", "--run", "nonesuch"],
                 ["report", "--run", "nonesuch", "-o", "x.html"]):
        result = gpuwatch(*args)
        assert result.returncode == 1 and "nonesuch" in result.stderr, (args, result)
    both = gpuwatch("report", "one", "--run", "other", "-o", "x.html")
    assert both.returncode == 2 and "two runs given" in both.stderr


def test_tail_spells_booleans_as_the_dashboard_and_set_do(fake_agent):
    fake_agent.knobs["pin_memory"] = False
    result = gpuwatch("tail", "--count", "3")
    assert "pin_memory=off" in result.stdout and "False" not in result.stdout


def test_no_ui_progress_line_reads_at_a_glance():
    from gpuwatch.cli import _progress_line

    assert _progress_line(None, 3) == "demo: no step yet (3s)"
    line = _progress_line({"step": 1200, "step_time_s": 0.2884, "samples_per_s": 109.2,
                           "loss": 2.0391}, 310)
    assert line == "demo: step 1,200  288 ms/step  109 samples/s  loss 2.04  (5m10s)"
    assert _progress_line({"step": 101}, 45, 101) == (
        "demo: paused after step 101 (gpuwatch set pause=off goes on)  (45s)")


def test_no_ui_progress_line_gives_the_recent_pace_not_a_warm_up_steps():
    """A newcomer's first line read ``step 4  1.17 s/step``: one step's own time. With
    the latest steps the line gives their mean over the window, labelled as the
    dashboard labels it."""
    from gpuwatch.cli import _progress_line
    from gpuwatch.state import RunState, recent_steps

    state = RunState()
    for step, step_time_s in enumerate([1.2, 0.03, 0.03, 0.03, 0.03, 0.03, 0.03, 0.03], 1):
        state.ingest({"type": "step", "seq": step, "t": 0.0, "rank": 0, "run_id": "r",
                      "body": {"step": step, "step_time_s": step_time_s, "samples": 16,
                               "samples_per_s": 16 / step_time_s, "loss": 4.0}})
    last = {"step": 8, "step_time_s": 0.03, "samples_per_s": 16 / 0.03, "loss": 4.0}
    recent = recent_steps(state.steps)
    # 1.41 s for 8 steps of 16 samples: 176 ms a step, 90.8 samples/s (the last alone:
    # 30.0 ms, 533 samples/s)
    assert _progress_line(last, 12, recent=recent) == (
        "demo: step 8  176 ms/step  90.8 samples/s (1s mean)  loss 4.00  (12s)")
    assert _progress_line(last, 12) == (
        "demo: step 8  30.0 ms/step  533 samples/s  loss 4.00  (12s)")


def test_a_job_in_a_long_step_is_killed_with_its_output_file_named(tmp_path, monkeypatch,
                                                                    capsys):
    """``q`` while the demo's job is in a long step: it is asked to stop, waited for,
    then killed, and the message names the output file that is kept (a stand-in job
    that ignores SIGINT plays the long step)."""
    from gpuwatch import cli

    monkeypatch.setattr(cli, "DEMO_STOP_TIMEOUT_S", 1.0)
    run_file = tmp_path / "run.json"
    run_file.write_text("{}")  # the job has not said bye: its run file is there
    log_path = tmp_path / "demo.log"
    job = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                            "signal.signal(signal.SIGINT, signal.SIG_IGN); "
                            "print('ready', flush=True); time.sleep(60)"],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline() == "ready\n"
        info = runs.RunInfo(run_id="r", rank=0, world_size=1, pid=job.pid,
                            pub_endpoint="", cmd_endpoint="", token="", started_at=0.0,
                            path=str(run_file))
        cli._stop_child(job, info, log_path=log_path)
        assert job.returncode == -9
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    out, err = capsys.readouterr()
    assert out == (f"gpuwatch demo: stopping the training job (pid {job.pid}) at the end "
                   "of its optimizer step; killed if that takes over 1 s (Ctrl-C: now) ...\n")
    assert err == ("gpuwatch demo: killed the training job (its step did not end within "
                   f"1 s); its output is kept in {log_path}\n")


def test_tail_for_people_says_hello_once(fake_agent):
    """The run repeats its hello (every 10 steps here) for subscribers that come late;
    a person reading the lines needs it once."""
    result = gpuwatch("tail", "--count", "25")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) >= 20  # two hellos' worth
    assert sum(line.startswith(f"run {fake_agent.info.run_id} ") for line in lines) == 1


@pytest.mark.parametrize("args", [("runs", "--all"), ("runs",)])
def test_output_into_a_closed_pipe_ends_quietly(run_dir, args):
    """``gpuwatch runs --all | head``: the reader has gone before the writing ends."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "gpuwatch", *args], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=30)
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (0, "")


def test_a_step_with_no_batch_seen_reads_unknown_not_0():
    """A monitoring-only session (`run.optimizer_step(loss)` alone) counts no batch."""
    from gpuwatch.cli import _human_line, _progress_line

    step = {"step": 3, "step_time_s": 0.1, "data_wait_s": 0.0, "samples": 0,
            "samples_per_s": 0.0, "loss": 2.0}
    assert _human_line({"type": "step", "body": step}) == (
        "step 3  100 ms  wait unknown  unknown samples/s  loss 2.00")
    assert "unknown samples/s" in _progress_line(step, 10)

"""``gpuwatch export``: tables of a run log (a real RunLog's) read back by pandas, and
live runs (a fake agent with real sockets) scraped as Prometheus metrics over HTTP on
127.0.0.1 from a real ``gpuwatch export --prometheus`` process."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.wire import protocol
from gpuwatch import history, tables
from tests.conftest import wait_until
from tests.test_branches import branched_run
from tests.test_history import gpuwatch, write_run
from tests.test_replay import KNOBS, RUN, Writer

H100 = {"index": 0, "name": "NVIDIA H100", "util_pct": 91.0, "mem_used_bytes": 60 << 30,
        "mem_total_bytes": 80 << 30, "power_w": 600.0, "temp_c": 70.0}


@pytest.fixture
def logged_run(run_dir):
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    return write_run(os.path.join(logs, f"{RUN}.rank0.runlog"), steps=50,
                     changes=[(21, "precision", "bf16"), (31, "pin_memory", False)],
                     events=[(40, "loader is slow")])


def logged_steps(path):
    return [record for record in history.flat_records(path) if record["type"] == "step"]


def test_csv_round_trip_through_pandas(logged_run, tmp_path):
    result = gpuwatch("export", RUN, "--csv", "-o", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"wrote {tmp_path}/run.steps.csv (50 rows)",
                                          f"wrote {tmp_path}/run.events.csv (3 rows)"]
    steps = pd.read_csv(tmp_path / "run.steps.csv")
    written = logged_steps(logged_run)
    assert list(steps["step"]) == [record["step"] for record in written]
    assert list(steps["step_time_s"]) == [record["step_time_s"] for record in written]
    assert list(steps["loss"]) == pytest.approx([record["loss"] for record in written])
    assert list(steps["host_rss_bytes"]) == [record["host_rss_bytes"] for record in written]
    assert set(steps["run"]) == {RUN} and set(steps["rank"]) == {0}
    # knobs: one column each, with the value at that step
    assert list(steps["knobs.precision"]) == ["fp32"] * 20 + ["bf16"] * 30
    assert list(steps["knobs.pin_memory"]) == [True] * 30 + [False] * 20
    assert list(steps["knobs.accum_steps"]) == [2] * 50
    events = pd.read_csv(tmp_path / "run.events.csv")
    assert list(events["kind"]) == ["applied", "applied", "warning"]
    assert list(events["value"].fillna("")) == ["bf16", "false", ""]
    # an applied event names its step; a warning has the last step completed before it
    assert list(events["step"]) == [21, 31, 40]


def test_parquet_round_trip_keeps_the_types(logged_run, tmp_path):
    result = gpuwatch("export", str(logged_run), "--parquet", "-o", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    steps = pd.read_parquet(tmp_path / "run.steps.parquet")
    written = logged_steps(logged_run)
    assert list(steps["step"]) == [record["step"] for record in written]
    assert list(steps["loss"]) == [record["loss"] for record in written]
    assert list(steps["t"]) == [record["t"] for record in written]
    assert str(steps["step"].dtype) == "int64" and str(steps["loss"].dtype) == "float64"
    assert str(steps["knobs.pin_memory"].dtype) == "bool"
    assert str(steps["knobs.precision"].dtype).startswith("str")
    assert list(steps["knobs.accum_steps"]) == [2] * 50
    assert steps["activation_bytes"].isna().sum() == 47  # measured every 20 steps
    events = pd.read_parquet(tmp_path / "run.events.parquet")
    assert list(events["kind"]) == ["applied", "applied", "warning"]
    assert list(events["step"]) == [21, 31, 40] and str(events["step"].dtype) == "int64"
    assert list(events["text"])[-1] == "loader is slow"


@pytest.mark.parametrize("table_format", ["csv", "parquet"])
def test_a_branched_runs_tables_tell_its_branches_apart(run_dir, tmp_path, table_format):
    # a newcomer's export of a branched run had steps 399-577 twice, nothing to tell them
    # apart; b0 trains 1-200, b1 goes back to 120 and trains 121-300 (test_branches)
    path = branched_run(run_dir)
    result = gpuwatch("export", path, f"--{table_format}", "-o", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    read = pd.read_csv if table_format == "csv" else pd.read_parquet
    steps = read(tmp_path / f"run.steps.{table_format}")
    assert list(zip(steps["branch"], steps["step"])) == (
        [(0, step) for step in range(1, 201)] + [(1, step) for step in range(121, 301)])
    assert str(steps["branch"].dtype) == "int64"
    events = read(tmp_path / f"run.events.{table_format}")
    by_kind = dict(zip(events["kind"] + ":" + events["text"].str[:10], events["branch"]))
    assert by_kind == {"applied:accum_step": 0, "branched:rewound to": 1,
                       "applied:lr_scale=0": 1, "applied:pause=on a": 1}


def test_export_streams_a_long_log_in_chunks(logged_run, tmp_path, monkeypatch):
    """Rows are written a chunk at a time: the same table as at once."""
    monkeypatch.setattr(tables, "CHUNK_ROWS", 7)
    for table_format in ("csv", "parquet"):
        [(path, rows), _], reader = tables.write_tables(
            history.log_at(logged_run), tmp_path / table_format, table_format)
        assert reader.malformed == 0 and not reader.truncated
        steps = (pd.read_csv(path) if table_format == "csv" else pd.read_parquet(path))
        assert rows == 50 and list(steps["step"]) == list(range(1, 51))
        assert list(steps["knobs.precision"]) == ["fp32"] * 20 + ["bf16"] * 30


def test_export_needs_a_run_and_a_format(run_dir):
    assert gpuwatch("export", "--csv").returncode == 2
    assert gpuwatch("export", RUN).returncode == 2  # no format: argparse says so
    missing = gpuwatch("export", "nosuchrun", "--csv")
    assert missing.returncode == 1 and "no run log matches" in missing.stderr


@contextlib.contextmanager
def exporter_at(*options):
    """A real ``gpuwatch export --prometheus 127.0.0.1:0`` process: yields it and the
    URL it says it serves; it must stop on SIGTERM with status 0 (killed otherwise)."""
    exporter = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "export", "--prometheus", "127.0.0.1:0",
         *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = exporter.stdout.readline()
        assert line.startswith("serving gpuwatch_* metrics"), exporter.stderr.read()
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        yield exporter, url
        exporter.send_signal(signal.SIGTERM)
        assert exporter.wait(10) == 0
    finally:
        if exporter.poll() is None:
            exporter.kill()
            exporter.wait()


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return {family.name: family for family in
                text_string_to_metric_families(response.read().decode())}


def test_prometheus_scrape_of_a_live_run(make_agent):
    agent = make_agent(gpus=[H100], knobs={"precision": "bf16", "accum_steps": 2},
                       step_fields={"tokens": 4096, "tokens_per_s": 80_000.0,
                                    "activation_bytes": 3 << 20})
    with exporter_at() as (_, url):
        def scraped():  # the exporter subscribes within a second, then steps and a hello
            families = scrape(url)
            steps, info = families.get("gpuwatch_steps"), families.get("gpuwatch_run_info")
            ready = (steps is not None and steps.samples and steps.samples[0].value >= 3
                     and info.samples[0].labels["device"])
            return families if ready else None

        families = wait_until(scraped, "3 steps and a device in the scrape", timeout_s=30,
                              poll_s=0.1, detail=lambda: str(sorted(scrape(url))))
        run = {"run": agent.info.run_id, "rank": "0"}

        def values(name):
            return {tuple(sorted((k, v) for k, v in s.labels.items() if k not in run)):
                    s.value for s in families[name].samples if s.labels.items() >= run.items()}

        assert values("gpuwatch_run_info") == {(("device", "cpu"), ("name", "fake-train")): 1}
        assert values("gpuwatch_run_up") == {(): 1}
        assert values("gpuwatch_optimizer_step")[()] >= 3
        assert values("gpuwatch_knob_info") == {(("knob", "accum_steps"), ("value", "2")): 1,
                                                (("knob", "precision"), ("value", "bf16")): 1}
        memory = values("gpuwatch_memory_bytes")
        assert memory[(("kind", "host_rss"),)] == 700 << 20
        assert memory[(("kind", "cuda_peak_reserved"),)] == 7 << 30
        assert memory[(("kind", "activation"),)] == 3 << 20
        assert values("gpuwatch_gpu_utilization_percent") == {(("gpu", "0"),): 91.0}
        assert values("gpuwatch_gpu_power_watts") == {(("gpu", "0"),): 600.0}
        assert values("gpuwatch_tokens_per_second") == {(): 80_000.0}
        # the fake's own figure for the step exported (1,600 less step % 13), passed
        # through: not a measured speed
        step = values("gpuwatch_optimizer_step")[()]
        assert values("gpuwatch_samples_per_second")[()] == 1600.0 - step % 13
        summary = {s.name: s.value for s in families["gpuwatch_step_time_seconds"].samples
                   if s.labels.items() >= run.items()}
        assert summary["gpuwatch_step_time_seconds_count"] >= 3
        assert 0.02 <= summary["gpuwatch_step_time_seconds_sum"] / summary[
            "gpuwatch_step_time_seconds_count"] <= 0.05
        assert values("gpuwatch_tokens_total" if "gpuwatch_tokens_total" in families
                      else "gpuwatch_tokens")[()] >= 3 * 4096


def test_csv_and_parquet_read_back_with_the_same_types_and_values(run_dir, tmp_path):
    """Float knobs are numbers in both (``lr_scale * 2`` is arithmetic, not "1.01.0"),
    a float that is whole is still a float in CSV, bytes measured now and then are the
    same dtype in both, and each event has the step the log gives it."""
    path = write_run(os.path.join(run_dir, f"{RUN}.rank0.runlog"), steps=50, changes=[
        (1, "lr_scale", 1.0), (11, "lr_scale", 0.5), (1, "weight_decay", 0.01),
        (1, "max_grad_norm", 1), (21, "max_grad_norm", 1.5)], events=[(40, "loader")])
    for table_format in ("csv", "parquet"):
        result = gpuwatch("export", str(path), f"--{table_format}", "-o",
                          str(tmp_path / "run"))
        assert result.returncode == 0, result.stderr
    for kind, text in (("steps", {}), ("events", {"value": "str"})):
        # (CSV has no types: text that reads as numbers, here every change's value)
        from_csv = pd.read_csv(tmp_path / f"run.{kind}.csv", dtype=text)
        from_parquet = pd.read_parquet(tmp_path / f"run.{kind}.parquet")
        assert dict(from_csv.dtypes) == dict(from_parquet.dtypes), kind
        pd.testing.assert_frame_equal(from_csv, from_parquet, check_exact=True)
        nullable = [pd.read_csv(tmp_path / f"run.{kind}.csv",
                                dtype={name: "string" for name in text},
                                dtype_backend="numpy_nullable"),
                    pd.read_parquet(tmp_path / f"run.{kind}.parquet",
                                    dtype_backend="numpy_nullable")]
        assert dict(nullable[0].dtypes) == dict(nullable[1].dtypes), kind
    steps = pd.read_parquet(tmp_path / "run.steps.parquet")
    assert list(steps["knobs.lr_scale"] * 2) == [2.0] * 10 + [1.0] * 40
    assert list(steps["knobs.max_grad_norm"]) == [1.0] * 20 + [1.5] * 30
    assert set(steps["knobs.weight_decay"]) == {0.01}
    assert str(steps["activation_bytes"].dtype) == "float64"  # int64 with gaps, as in CSV
    assert list(steps["activation_bytes"].dropna()) == [17 << 20] * 3
    nullable = pd.read_csv(tmp_path / "run.steps.csv", dtype_backend="numpy_nullable")
    assert str(nullable["activation_bytes"].dtype) == "Int64"
    assert str(nullable["knobs.lr_scale"].dtype) == "Float64"
    events = pd.read_csv(tmp_path / "run.events.csv")
    applied = [record for record in history.flat_records(path)
               if record["type"] == "event" and record.get("step") is not None]
    assert list(events["step"])[:-1] == [record["step"] for record in applied] == [
        1, 1, 1, 11, 21]
    assert list(events["step"])[-1] == 40  # a warning: the last step completed before it


def test_csv_cells_that_a_spreadsheet_would_run_start_with_a_quote(run_dir, tmp_path):
    """OWASP's CSV-injection rule: a text cell starting with = + - @, a tab or a carriage
    return gets a single quote before it (in CSV only); numbers stay numbers."""
    formulas = ["=HYPERLINK(\"http://x\")", "+1+2", "-2+3", "@SUM(A1)", "\tcmd", "\rcmd"]
    path = write_run(os.path.join(run_dir, f"{RUN}.rank0.runlog"), steps=10,
                     changes=[(3, "precision", formulas[0]), (8, "precision", formulas[4]),
                              (9, "precision", formulas[5])],
                     events=[(4, formulas[1]), (5, formulas[2]), (6, formulas[3])])
    for table_format in ("csv", "parquet"):
        assert gpuwatch("export", str(path), f"--{table_format}", "-o",
                        str(tmp_path / "run")).returncode == 0
    steps = pd.read_csv(tmp_path / "run.steps.csv")
    assert list(steps["knobs.precision"]) == (
        ["fp32"] * 2 + ["'" + formulas[0]] * 5 + ["'\tcmd"] + ["'\rcmd"] * 2)
    assert list(steps["step_time_s"]) == [0.1] * 10 and list(steps["step"]) == list(
        range(1, 11))
    events = pd.read_csv(tmp_path / "run.events.csv")
    assert list(events["value"])[0] == "'" + formulas[0]
    assert list(events["text"])[0] == f"precision={formulas[0]} applied at step 3"
    assert list(events["text"])[1:4] == ["'" + text for text in formulas[1:4]]
    parquet = pd.read_parquet(tmp_path / "run.events.parquet")
    assert list(parquet["text"])[1:4] == formulas[1:4]  # not for spreadsheets: as it is
    raw = (tmp_path / "run.steps.csv").read_text()
    assert ",'" not in raw.replace(",\"'", "")  # only quoted text cells, no number, changed


def test_values_that_cannot_be_read_are_missing_in_the_tables(run_dir, tmp_path):
    """A crafted log: steps and events whose step is 1e308, text, 2**70 or negative,
    a time and a start of 1e308, knob values of the wrong type: read as missing (an
    event's step: the last step completed before it; a knob of mixed types: text), no
    traceback from export, report, compare or ``runs --all``."""
    os.makedirs(os.path.join(run_dir, "logs"), mode=0o700)
    path = Path(run_dir) / "logs" / f"{RUN}.rank0.runlog"
    writer = Writer(str(path), t0=1e9)
    writer.write("hello", {"name": "odd", "device": "cpu", "started_at": 1e308})
    for step in range(1, 11):
        writer.step(step, lr_scale=1e308 if step == 2 else "x" if step == 3 else 1.0)
    for odd in (1e308, "eleven"):
        writer.write("steps", protocol.steps_body({"step": [odd], "knobs": [KNOBS]}))
    writer.step(12, knobs={**KNOBS, "accum_steps": "two", "pin_memory": "yes"})
    for named in (1e308, "x", 1 << 70, -5, 7):
        writer.write("event", {"level": "warning", "text": f"named {named!r}",
                               "step": named})
    writer.write("steps", {"n": 1, "columns": {"step": [13]}}, dt_s=1e308)
    writer.log.close()
    for command in (("export", str(path), "--csv", "-o", str(tmp_path / "run")),
                    ("export", str(path), "--parquet", "-o", str(tmp_path / "run")),
                    ("report", str(path), "-o", str(tmp_path / "report.html")),
                    ("compare", str(path)), ("runs", "--all")):
        result = gpuwatch(*command)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (
            command, result.stderr)
    assert "<td>started</td><td>-</td>" in (tmp_path / "report.html").read_text()
    steps = pd.read_parquet(tmp_path / "run.steps.parquet")
    assert steps["step"].tolist()[:10] == list(range(1, 11))
    assert steps["step"].isna().tolist()[10:12] == [True, True]
    assert list(steps["step"])[12:] == [12, 13]
    assert steps["lr_scale"].tolist()[:2] == [1.0, 1e308]
    assert steps["lr_scale"].isna().tolist()[:4] == [False, False, True, False]
    assert list(steps["knobs.accum_steps"])[-2] == "two"  # a mix of types is text
    assert str(steps["t"].dtype) == "float64"
    events = pd.read_csv(tmp_path / "run.events.csv")
    assert list(events["step"]) == [12, 12, 12, 12, 7]


def _status(url, token=None):
    request = urllib.request.Request(url, headers={} if token is None else {
        "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_prometheus_with_a_token_file_answers_only_scrapes_that_carry_it(run_dir, tmp_path):
    """--token-file: a new token (mode 0600) is made; a real HTTP request without it, or
    with another, gets 401 and no metric; with it, the metrics. A token file others can
    read is refused."""
    token_file = tmp_path / "token"
    with exporter_at("--token-file", str(token_file)) as (exporter, url):
        assert exporter.stdout.readline().strip() == (
            f"scrapes need the bearer token in {token_file} (made now, mode 0600)")
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) == 64
        for wrong in (None, "", token[:-1], token + "0", "x" * 64):
            code, body = _status(url, wrong)
            assert code == 401 and "gpuwatch_" not in body, (wrong, code, body)
        code, body = _status(url, token)
        assert code == 200 and "# TYPE gpuwatch_run_up gauge" in body, body
    os.chmod(token_file, 0o644)
    refused = gpuwatch("export", "--prometheus", "127.0.0.1:0", "--token-file",
                       str(token_file))
    assert refused.returncode == 2 and "readable or writable by others" in refused.stderr
    assert len(refused.stderr.splitlines()) == 1 and "Traceback" not in refused.stderr


def test_a_number_knob_beyond_any_float_is_missing_in_the_tables(run_dir, tmp_path):
    """A JSON-lines log (of the earlier format) holds integers of any size: a number knob
    set to 2**1100 is missing at those steps, its column still numbers."""
    path = write_run(os.path.join(run_dir, f"{RUN}.rank0.jsonl"), steps=6, legacy=True,
                     changes=[(1, "lr_scale", 0.5), (4, "lr_scale", 1 << 1100)])
    for table_format in ("csv", "parquet"):
        result = gpuwatch("export", str(path), f"--{table_format}", "-o",
                          str(tmp_path / "run"))
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    for steps in (pd.read_csv(tmp_path / "run.steps.csv"),
                  pd.read_parquet(tmp_path / "run.steps.parquet")):
        assert str(steps["knobs.lr_scale"].dtype) == "float64"
        assert steps["knobs.lr_scale"].tolist()[:3] == [0.5] * 3
        assert steps["knobs.lr_scale"].isna().tolist() == [False] * 3 + [True] * 3

"""``gpuwatch report`` and ``gpuwatch compare`` as real subprocesses on run logs written
by the real RunLog; the report opened in a real headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from tests.test_history import gpuwatch, write_run
from tests.test_replay import RUN

#: Chromium (Debian's package), for the report's rendering; .ci/run installs it.
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: The report's colour for knob-change lines (gpuwatch.report.MARK_COLOR), as RGB.
MARK_RGB = (0xC2, 0x18, 0x5B)
#: matplotlib's first line colour (C0), the data's.
LINE_RGB = (0x1F, 0x77, 0xB4)


@pytest.fixture
def logged_run(run_dir):
    """A finished run with two knob changes, in the run directory's log directory."""
    logs = os.path.join(run_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    return write_run(os.path.join(logs, f"{RUN}.rank0.jsonl"), steps=120,
                     changes=[(41, "precision", "bf16"), (81, "accum_steps", 4)],
                     events=[(60, "loader is slow")])


def chromium(*args, cwd):
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--no-first-run", "--hide-scrollbars",
         f"--user-data-dir={cwd / 'profile'}", *args], capture_output=True, text=True,
        timeout=120, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                    "(Debian: apt-get install chromium; .ci/run installs it as root)")
def test_report_renders_in_headless_chromium_with_plots_and_markers(logged_run, tmp_path):
    import matplotlib.image

    report = tmp_path / "report.html"
    result = gpuwatch("report", RUN[:16], "-o", str(report))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {report} (") and "2 knob changes" in result.stdout
    page = report.read_text()
    assert "<script" not in page and "http" not in page.replace("http-equiv", "")
    # the images as the browser laid them out (a copy of the page that says, after load)
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", """<script>
window.addEventListener("load", () => document.body.setAttribute("data-images",
  [...document.images].map(i => `${i.naturalWidth}x${i.naturalHeight}:${i.width}x${i.height}`)
  .join(" ")));</script></body>"""))
    dom = chromium("--dump-dom", probe.as_uri(), cwd=tmp_path)
    sizes = re.search(r'data-images="([^"]*)"', dom).group(1).split()
    assert len(sizes) == 5, sizes  # step time, throughput, loss, memory, activation
    for size in sizes:
        natural, shown = size.split(":")
        assert all(int(n) > 100 for n in natural.split("x") + shown.split("x")), sizes
    # the screenshot: plots drawn, and the knob changes' lines on them
    chromium("--screenshot=shot.png", "--window-size=1280,3000", report.as_uri(),
             cwd=tmp_path)
    pixels = matplotlib.image.imread(tmp_path / "shot.png")[..., :3] * 255
    def near(rgb):
        return int((abs(pixels - rgb) < 40).all(axis=-1).sum())

    assert near(MARK_RGB) > 2000, near(MARK_RGB)  # dashed lines in 5 plots, labels
    assert near(LINE_RGB) > 1000, near(LINE_RGB)  # the data's lines
    for text in ("Segments between knob changes", "precision=bf16", "accum_steps=4",
                 "<td>torch.version</td><td>2.13.0+cpu</td>", "TinyNet (1,234 parameters)",
                 "<td>steps 41-80 (precision=bf16)</td>", "<td>50.0 ms</td>"):
        assert text in page


def test_report_of_an_unknown_run_says_so(run_dir, tmp_path):
    result = gpuwatch("report", "nosuchrun", "-o", str(tmp_path / "r.html"))
    assert result.returncode == 1 and "no run log matches 'nosuchrun'" in result.stderr
    assert not (tmp_path / "r.html").exists()


def test_compare_one_run_around_its_changes_and_two_runs(logged_run, run_dir):
    result = gpuwatch("compare", RUN)
    assert result.returncode == 0, result.stderr
    lines = {" ".join(line.split()[:2]): line.split()[2:]
             for line in result.stdout.splitlines()[1:]}
    assert result.stdout.splitlines()[0].split() == ["start", "precision=bf16",
                                                     "accum_steps=4"]
    assert lines["step time"] == ["(median)", "100", "ms", "50.0", "ms", "50.0", "ms"]
    assert lines["samples/s (median)"] == ["320", "640", "640"]
    assert lines["memory (peak)"] == ["500.0", "MiB", "500.0", "MiB", "400.0", "MiB"]
    [first, second, third] = json.loads(gpuwatch("compare", RUN, "--json").stdout)
    assert (second["first_step"], second["changed"], second["step_time_s"]) == (
        41, ["precision"], 0.05)
    other = write_run(os.path.join(run_dir, "logs", "20250102-000000-0ther.rank0.jsonl"),
                      steps=10)
    two = gpuwatch("compare", RUN, str(other))
    assert two.returncode == 0, two.stderr
    header = two.stdout.splitlines()[0].split()
    assert header[0] == RUN and header[-1] == "ratio"
    assert gpuwatch("compare", str(other)).returncode == 1  # no change to compare around
    late = write_run(os.path.join(run_dir, "logs", "20250103-000000-1ate.rank0.jsonl"),
                     steps=20, changes=[(10, "lr", 0.01)])  # a knob that appears mid-run
    rows = gpuwatch("compare", str(late)).stdout.splitlines()
    assert next(row for row in rows if row.startswith("lr")).split() == ["lr", "-", "0.01"]


def test_compare_of_a_run_with_20_changes_fits_120_columns_in_pages(run_dir):
    """20 changes: 21 segments, in pages of the columns that fit 120 characters, each
    with the labels, together every segment once and in order."""
    changes = [(11 + 10 * i, "precision", ("bf16", "fp32")[i // 2 % 2]) if i % 2 == 0
               else (11 + 10 * i, "num_workers", 10 + i) for i in range(20)]
    path = write_run(os.path.join(run_dir, f"{RUN}.rank0.runlog"), steps=210,
                     changes=changes)
    result = gpuwatch("compare", str(path), "--json")
    assert len(json.loads(result.stdout)) == 21, result.stderr
    lines = gpuwatch("compare", str(path)).stdout.splitlines()
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    heads = {i: re.fullmatch(r"columns? (\d+)(?:-(\d+))? of 21", line)
             for i, line in enumerate(lines)}
    pages = [i for i, head in heads.items() if head]
    assert len(pages) >= 2 and pages[0] == 0
    ranges, titles = [], []
    for start, end in zip(pages, [*pages[1:], len(lines) + 1]):
        page = [re.split(r"\s{2,}", line.strip()) for line in lines[start + 1:end - 1]]
        first, last = heads[start].groups()
        first, last = int(first), int(last or first)
        titles += page[0]
        [steps] = [row[1:] for row in page if row[0] == "steps"]
        assert len(steps) == last - first + 1 == len(page[0])
        ranges += steps
    assert ranges == ["1-10 (10)", *(f"{s}-{s + 9} (10)" for s in range(11, 211, 10))]
    assert titles[0] == "start" and titles[1:] == [f"{knob}={value}" for _, knob, value
                                                   in changes]

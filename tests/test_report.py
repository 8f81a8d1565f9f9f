"""``gpuwatch report`` and ``gpuwatch compare`` as real subprocesses on run logs written
by the real RunLog; the report opened in a real headless Chromium."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess

import pytest

from tests.test_history import gpuwatch, write_run
from tests.test_replay import KNOBS, RUN, Writer

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
    # each run's knobs as at its start, then at its end where they changed (a newcomer
    # read the start's fp32 for a run that ended in bf16)
    knobs = {line.split()[0]: line.split()[1:] for line in two.stdout.splitlines()[1:3]}
    assert knobs == {"precision": ["fp32", "->", "bf16", "fp32"],
                     "accum_steps": ["2", "->", "4", "2"]}
    assert gpuwatch("compare", str(other)).returncode == 1  # no change to compare around
    late = write_run(os.path.join(run_dir, "logs", "20250103-000000-1ate.rank0.jsonl"),
                     steps=20, changes=[(10, "lr", 0.01)])  # a knob that appears mid-run
    rows = gpuwatch("compare", str(late)).stdout.splitlines()
    assert next(row for row in rows if row.startswith("lr")).split() == ["lr", "-", "0.01"]


def test_compare_says_when_other_work_on_the_host_moved_the_speed(run_dir):
    """Other processes kept 3 of the host's 4 cores busy until the change at step 41 (the
    host at 100%, the run at one core), then none: each segment's share is the mean of its
    samples (a damaged sample is passed over), and the table warns that the speed-up is
    the load's as well as the knob's. Without that gap, no warning."""
    def busy_then_quiet(step):
        if step == 30:
            return {"cpu_pct": "x", "process_cpu_pct": 100.0}  # (damaged: not counted)
        return {"cpu_pct": 100.0 if step <= 40 else 25.0, "process_cpu_pct": 90.0,
                "children_cpu_pct": 10.0} if step % 10 == 0 else None

    path = write_run(os.path.join(run_dir, f"{RUN}.rank0.runlog"), steps=80,
                     changes=[(41, "precision", "bf16")], system=busy_then_quiet)
    result = gpuwatch("compare", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert next(line for line in lines if line.startswith("host CPU")).split() == [
        "host", "CPU,", "other", "work", "75%", "0%"]
    assert lines[-1] == ("note: other work kept 75% of the host's CPU busy in column 1, 0% "
                         "in column 2: the speeds compare that load too")
    shares = [column["other_cpu_share"] for column
              in json.loads(gpuwatch("compare", str(path), "--json").stdout)]
    assert shares == [0.75, 0.0]
    steady = write_run(os.path.join(run_dir, "20250102-000000-0ther.rank0.runlog"), steps=80,
                       changes=[(41, "precision", "bf16")],
                       system=lambda step: {"cpu_pct": 60.0, "process_cpu_pct": 100.0})
    result = gpuwatch("compare", str(steady))
    assert "35%" in result.stdout and "note:" not in result.stdout, result.stdout


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


def _crowded_run(run_dir):
    """A run of 3,000,000 steps (300 records 10,000 steps apart) of about 1.2 s with a
    spike of 90 s and a loss near 1e-6, whose knob changes come in bursts (12 changes
    10,000 steps apart, then 6 spread out)."""
    path = os.path.join(run_dir, f"{RUN}.rank0.runlog")
    writer = Writer(path, t0=1e9)
    writer.hello()
    knobs = dict(KNOBS)
    change_at = {*range(100, 112), 150, 180, 200, 230, 260, 290}
    for index in range(1, 301):
        if index in change_at:
            knobs = {**knobs, "num_workers": index}
        writer.step(index * 10_000, knobs=dict(knobs), loss=1e-6 / index,
                    step_time_s=90.0 if index == 200 else 1.2 + index % 3 * 0.01)
    writer.log.close()
    return path, len(change_at)


def test_report_plots_label_every_change_without_overlap_and_no_scientific_notation(run_dir):
    from matplotlib import pyplot

    from gpuwatch import history, report

    path, changes = _crowded_run(run_dir)
    run = history.read_history(history.log_at(path))
    assert len(run.knob_changes) == changes
    figure = report.figure_of(run, "Step time", [("step time", "step_time_s", 1e3)], "ms",
                              clip_spikes=True)
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        [axes] = figure.axes
        labels = [text for text in axes.texts if text.get_text()]
        boxes = [label.get_window_extent(renderer) for label in labels]
        for i, one in enumerate(boxes):
            for other in boxes[i + 1:]:
                assert not one.overlaps(other), [label.get_text() for label in labels]
        shown = [label.get_text() for label in labels]
        more = sum(int(re.search(r"\+(\d+) more", text).group(1)) for text in shown
                   if "more" in text)
        assert len(shown) + more == changes and 2 <= len(shown) < changes, shown
        assert shown[0].startswith("num_workers=100 +") and shown[-1] == "num_workers=290"
        words = [axes.get_title(loc="left"), *shown,
                 *(tick.get_text() for tick in axes.get_xticklabels()),
                 *(tick.get_text() for tick in axes.get_yticklabels())]
        assert "axis cut at" in words[0] and "largest 90,000" in words[0], words[0]
        assert "3,000,000" in words
        assert not [word for word in words if re.search(r"\de[+-]?\d", word)], words
    finally:
        pyplot.close(figure)
    loss = report.figure_of(run, "Loss", [("loss", "loss", 1.0)], "loss")
    try:
        loss.canvas.draw()
        ticks = [tick.get_text() for tick in loss.axes[0].get_yticklabels()]
        assert ticks and not [t for t in ticks if re.search(r"e|\u00d7", t)], ticks
    finally:
        pyplot.close(loss)


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed")
@pytest.mark.parametrize("width_px", [1400, 1000])
def test_report_fits_a_window_of_1400_and_1000_px(run_dir, tmp_path, width_px):
    """Nothing wider than the window: the plots scale down, a table wider than the
    page scrolls in its own box; a screenshot of each width is kept to look at."""
    path, _ = _crowded_run(run_dir)
    report = tmp_path / "report.html"
    assert gpuwatch("report", str(path), "-o", str(report)).returncode == 0
    probe = tmp_path / "probe.html"
    probe.write_text(report.read_text().replace("</body>", """<script>
window.addEventListener("load", () => {
  const page = document.body.getBoundingClientRect();
  const out = [...document.querySelectorAll("table, img")].filter(e => {
    const box = e.getBoundingClientRect(), holder = e.closest("div.wide");
    return box.left < page.left - 1 || (box.right > page.right + 1 && !(holder
      && getComputedStyle(holder).overflowX === "auto"
      && holder.getBoundingClientRect().right <= page.right + 1));
  }).map(e => e.tagName + (e.className ? "." + e.className : ""));
  document.body.setAttribute("data-fit", JSON.stringify({
    window: window.innerWidth, page: document.documentElement.scrollWidth,
    tables: document.querySelectorAll("div.wide > table").length, out}));
});</script></body>"""))
    dom = chromium("--dump-dom", f"--window-size={width_px},2000", probe.as_uri(),
                   cwd=tmp_path)
    fit = json.loads(html.unescape(re.search(r'data-fit="([^"]*)"', dom).group(1)))
    assert fit["window"] == width_px and fit["page"] <= width_px, fit
    assert fit["tables"] == 3 and fit["out"] == [], fit  # facts, changes, segments
    chromium(f"--screenshot=report-{width_px}.png", f"--window-size={width_px},5000",
             report.as_uri(), cwd=tmp_path)
    assert (tmp_path / f"report-{width_px}.png").stat().st_size > 10_000

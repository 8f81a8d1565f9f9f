"""The system probe on this host: real child processes, real /proc files, psutil beside it."""

import os
import subprocess
import sys

import psutil
import pytest

from agent.io.probes import CHILDREN_SCAN_EVERY, SystemProbe, descendant_pids
from gpuopt.memory import host_rss_bytes

#: A child that starts a grandchild, says its pid, then waits for stdin.
_PARENT = ("import subprocess, sys; "
           "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], "
           "stdin=subprocess.PIPE); print(child.pid, flush=True); sys.stdin.read()")
#: A child that, at each line on stdin, burns 0.1 s of its own CPU, then says so.
_BURNER = ("import sys, time\n"
           "for line in sys.stdin:\n"
           "    start = time.process_time()\n"
           "    while time.process_time() - start < 0.1: pass\n"
           "    print('burnt', flush=True)\n")


@pytest.fixture
def child():
    """``start(code)``: a Python child process running ``code``, ended after the test."""
    started = []

    def start(code: str) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stdin.close()  # each ends at the end of its input (the grandchild with it)
        process.wait(30)


def test_descendant_pids_finds_children_and_grandchildren_as_psutil_does(child):
    parent = child(_PARENT)
    grandchild = int(parent.stdout.readline())
    found = descendant_pids(os.getpid())
    if found is None:
        pytest.skip("this kernel has no /proc/<pid>/task/<tid>/children")
    assert parent.pid in found and grandchild in found
    assert found.index(parent.pid) < found.index(grandchild)  # parents first
    assert set(found) == {process.pid for process in psutil.Process().children(recursive=True)}
    assert descendant_pids(grandchild) == []


def test_children_cpu_counts_a_busy_child_from_its_second_reading(child):
    probe = SystemProbe()
    burner = child(_BURNER)
    assert probe.children_cpu_pct() == 0.0  # first seen: primed, not counted
    burner.stdin.write("go\n")
    burner.stdin.flush()
    assert burner.stdout.readline() == "burnt\n"
    assert probe.children_cpu_pct() > 0.0


def _burn(burner: subprocess.Popen) -> None:
    burner.stdin.write("go\n")
    burner.stdin.flush()
    assert burner.stdout.readline() == "burnt\n"


def _files_open_on(path: str) -> int:
    """How many of this process's descriptors are open on ``path``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:  # (the listing's own descriptor, closed since)
            continue
    return count


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="Linux's /proc")
def test_children_are_found_by_a_scan_every_few_readings_and_dropped_when_they_end(child):
    """Between two scans of the process tree only the children known are read; one that
    ended is dropped (its /proc file closed) and the next reading scans again."""
    probe = SystemProbe()
    assert probe.children_cpu_pct() == 0.0  # a scan: no child yet
    burner = child(_BURNER)
    for _ in range(CHILDREN_SCAN_EVERY - 1):
        _burn(burner)
        assert probe.children_cpu_pct() == 0.0  # not known before the next scan
    assert probe.children_cpu_pct() == 0.0  # the scan: first seen
    _burn(burner)
    assert probe.children_cpu_pct() > 0.0
    # its own descriptor on the child's file (another agent's probe in this process,
    # one a test left running, reads it too: the count of descriptors is not this one's)
    path = f"/proc/{burner.pid}/stat"
    handle = probe._children[burner.pid][0]
    assert os.readlink(f"/proc/self/fd/{handle}") == path
    opened = _files_open_on(path)
    burner.stdin.close()
    burner.wait(30)
    assert probe.children_cpu_pct() == 0.0  # it ended: dropped
    assert burner.pid not in probe._children
    assert _files_open_on(path) < opened  # its descriptor closed
    later = child(_BURNER)
    assert probe.children_cpu_pct() == 0.0  # a scan at once: first seen
    _burn(later)
    assert probe.children_cpu_pct() > 0.0
    probe.close()


def test_a_sample_agrees_with_psutil():
    probe = SystemProbe()
    probe.sample()
    probe.close()  # its /proc files: opened again at the next sample
    sample = probe.sample()
    assert sample["host_mem_total_bytes"] == psutil.virtual_memory().total
    assert 0 < sample["host_mem_used_bytes"] < sample["host_mem_total_bytes"]
    rss = psutil.Process().memory_info().rss
    assert 0.5 * rss < sample["host_rss_bytes"] < 2 * rss
    assert 0.5 * rss < host_rss_bytes() < 2 * rss
    assert 0.0 <= sample["cpu_pct"] <= 100.0
    assert sample["process_cpu_pct"] >= 0.0 and sample["children_cpu_pct"] >= 0.0

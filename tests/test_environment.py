"""The environment report: complete, serialisable, never raising, runnable as a module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import torch

from gpuopt import environment
from gpuopt.environment import GROUPS, environment_report, format_report

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    return environment_report()


def test_report_has_every_group_and_key(report):
    assert list(report) == list(GROUPS)
    assert {"version", "platform"} <= set(report["python"])
    assert {"version", "num_threads", "float32_matmul_precision"} <= set(report["torch"])
    assert {
        "available",
        "version",
        "device_count",
        "devices",
        "bf16_supported",
        "matmul_allow_tf32",
        "cudnn_enabled",
        "cudnn_version",
        "cudnn_allow_tf32",
    } <= set(report["cuda"])
    assert {"count", "capability", "bf16_autocast"} <= set(report["cpu"])
    assert {"available", "version"} <= set(report["triton"])
    assert {"available", "built"} <= set(report["mps"])
    assert report["torch"]["version"] == str(torch.__version__)
    assert report["torch"]["num_threads"] == torch.get_num_threads()


def test_report_is_json_and_msgpack_serialisable(report):
    assert json.loads(json.dumps(report)) == report
    assert msgpack.unpackb(msgpack.packb(report)) == report


def test_text_rendering_groups_and_states_missing_cuda(report):
    text = format_report(report)
    for title in ("Python", "Torch", "CUDA", "CPU", "Triton"):
        assert f"\n{title}" in f"\n{text}"
    if not report["cuda"]["available"]:
        assert "no CUDA device" in text
        if report["triton"]["available"]:  # installed, but say that it cannot run here
            assert "kernels:" in text and "need a CUDA device; none here" in text


def test_a_failing_probe_is_recorded_not_raised(monkeypatch):
    def broken() -> int:
        raise RuntimeError("thread pool gone")

    monkeypatch.setattr(torch, "get_num_threads", broken)
    report = environment_report()
    assert report["torch"]["num_threads"] == "error: RuntimeError: thread pool gone"
    assert report["torch"]["version"] == str(torch.__version__)
    assert "thread pool gone" in format_report(report)


def test_absent_triton_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    triton = environment_report()["triton"]
    assert triton["available"] is False and triton["version"] is None
    assert triton["error"].startswith("error: ")


def test_cuda_devices_are_described(monkeypatch):
    # No GPU here: stand in a one-device CUDA to exercise that branch and its rendering.
    props = SimpleNamespace(total_memory=80 * 2**30, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Fake H100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    cuda = environment_report()["cuda"]
    assert cuda["device_count"] == 1 and cuda["bf16_supported"] is True
    assert cuda["devices"] == [
        {
            "index": 0,
            "name": "Fake H100",
            "compute_capability": "9.0",
            "total_memory_bytes": 80 * 2**30,
            "multi_processor_count": 132,
        }
    ]
    text = format_report({"cuda": cuda})
    assert "no CUDA device" not in text
    assert "device 0 name" in text and "80.0 GiB" in text


def test_main_prints_text(capsys):
    assert environment.main([]) == 0
    assert "Torch" in capsys.readouterr().out


def test_module_prints_json_as_a_subprocess():
    result = subprocess.run(
        [sys.executable, "-m", "gpuopt.environment", "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    parsed = json.loads(result.stdout)
    assert list(parsed) == list(GROUPS)
    assert parsed["python"]["version"] == environment_report()["python"]["version"]


def test_a_failing_cuda_probe_is_not_reported_as_no_device(monkeypatch):
    def broken() -> bool:
        raise RuntimeError("driver too old")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    report = environment_report()
    assert report["cuda"]["available"] == "error: RuntimeError: driver too old"
    text = format_report(report)
    assert "driver too old" in text and "no CUDA device" not in text


def test_the_report_starts_no_process():
    """The agent's I/O thread builds it: a subprocess spawned there while the training
    thread forks can hold that thread until the fork exits (``platform.platform()`` ran
    ``uname -p``)."""
    script = (
        "import sys\n"
        "spawned = []\n"
        "sys.addaudithook(lambda event, args: spawned.append(event) if event in "
        "('subprocess.Popen', 'os.posix_spawn', 'os.fork', 'os.exec') else None)\n"
        "from gpuopt.environment import environment_report\n"
        "import platform\n"
        "report = environment_report()\n"
        "print(spawned)\n"
        "print(report['python']['platform'])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT, check=True).stdout.splitlines()
    assert out[0] == "[]"
    if sys.platform == "linux":  # the same words as platform.platform()'s
        import platform
        assert out[1] == platform.platform()

"""Attacks from another local user, crafted logs and hostile agents, and the faults of
issue 11, each against real processes, sockets and terminals.

The other local user is a real unprivileged account (``gpuwatch-other``, created once
with ``useradd`` when missing, else ``nobody``), and its code runs in a child process
that drops to it with ``setpriv``: that needs root, so those tests are skipped with the
reason otherwise. Attacks that one user can stage alone (a link planted in one's own
directory) run without root.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agent import protocol, runs
from agent.runlog import RunLog, UnsafeLogFileError

ROOT = Path(__file__).resolve().parent.parent
VICTIM = ROOT / "tests" / "victim_job.py"


# --- people and processes ------------------------------------------------------------

class User:
    """Runs Python code as a given local user (a child process)."""

    def __init__(self, uid: int, gid: int) -> None:
        self.uid, self.gid = uid, gid

    @property
    def foreign(self) -> bool:
        return self.uid != os.getuid()

    def command(self, code: str, *args: str) -> list[str]:
        prefix = ([shutil.which("setpriv"), f"--reuid={self.uid}", f"--regid={self.gid}",
                   "--clear-groups"] if self.foreign else [])
        return [*prefix, sys.executable, "-c", code, *map(str, args)]

    def env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
                "HOME": "/"}

    def run(self, code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        result = subprocess.run(self.command(code, *args), env=self.env(), cwd="/",
                                capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, result.stderr
        return result

    def start(self, code: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.command(code, *args), env=self.env(), cwd="/",
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="session")
def other_user() -> User:
    """A second, unprivileged local user (skips unless this runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("a second local user needs root (useradd, setpriv): run the tests "
                    "as root to stage attacks from another user")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to run code as another user")
    name = "gpuwatch-other"
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if shutil.which("useradd"):
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                            "/usr/sbin/nologin", name], capture_output=True)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            entry = pwd.getpwnam("nobody")
    return User(entry.pw_uid, entry.pw_gid)


@pytest.fixture
def planter(request) -> User:
    """Who plants links: the other user when the tests run as root, else this user
    (a link is refused whoever planted it)."""
    if os.geteuid() == 0 and shutil.which("setpriv"):
        return request.getfixturevalue("other_user")
    return User(os.getuid(), os.getgid())


@pytest.fixture
def shared_tmp():
    """A directory like /tmp: world-writable with the sticky bit."""
    path = Path(tempfile.mkdtemp(prefix="gw-tmp-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Job:
    """``tests/victim_job.py``: real training with the agent, in a child process."""

    def __init__(self, env: dict[str, str], transport: str = "ipc", min_steps: int = 20):
        self.process = subprocess.Popen(
            [sys.executable, str(VICTIM), transport, str(min_steps)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        line = self.process.stdout.readline()
        assert line, self.process.stderr.read()
        self.started = json.loads(line)

    def stop(self) -> dict:
        """Let it end (after its MIN_STEPS); its summary."""
        self.process.stdin.close()
        line = self.process.stdout.readline()
        assert self.process.wait(60) == 0, self.process.stderr.read()
        return json.loads(line)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def job_env(**changes: str | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def gpuwatch(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run([sys.executable, "-m", "gpuwatch", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


# --- V2: the run directory -----------------------------------------------------------

def test_private_dir_refuses_links_other_owners_and_open_modes(tmp_path, planter):
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(runs.UnsafeDirectoryError, match="symbolic link"):
        runs.private_dir(link)
    (tmp_path / "file").write_text("")
    with pytest.raises(runs.UnsafeDirectoryError, match="not a directory"):
        runs.private_dir(tmp_path / "file")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(runs.UnsafeDirectoryError, match="writable by other users"):
        runs.private_dir(open_dir)
    assert stat.S_IMODE(open_dir.stat().st_mode) == 0o777  # refused: left as it was
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    assert runs.private_dir(readable) == readable
    assert stat.S_IMODE(readable.stat().st_mode) == 0o700  # ours: made private
    unsafe_parent = tmp_path / "everyone"
    unsafe_parent.mkdir()
    unsafe_parent.chmod(0o777)  # world-writable without the sticky bit
    with pytest.raises(runs.UnsafeDirectoryError, match="no sticky bit"):
        runs.private_dir(unsafe_parent / "runs")
    if planter.foreign:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, planter.uid, planter.gid)
        with pytest.raises(runs.UnsafeDirectoryError, match=f"belongs to uid {planter.uid}"):
            runs.private_dir(theirs)


def test_a_link_planted_at_the_default_run_directory_is_refused(shared_tmp, planter,
                                                                 tmp_path):
    victims_dir = tmp_path / "project"  # a directory of the victim's, open to read
    victims_dir.mkdir(mode=0o755)
    (victims_dir / "notes.txt").write_text("mine")
    default = shared_tmp / f"gpuwatch-{os.getuid()}"
    planter.run("import os, sys; os.symlink(sys.argv[1], sys.argv[2])",
                str(victims_dir), str(default))
    env = job_env(TMPDIR=str(shared_tmp), GPUWATCH_RUN_DIR=None, XDG_RUNTIME_DIR=None,
                  GPUWATCH_LOG_DIR=str(tmp_path / "logs"))
    job = Job(env)
    try:
        assert job.started["run_file"] is None  # no run file anywhere
        summary = job.stop()
    finally:
        job.kill()
    assert summary["steps"] >= 20  # training went on, unobserved
    assert any("symbolic link" in error for error in summary["errors"]), summary
    assert stat.S_IMODE(victims_dir.stat().st_mode) == 0o755  # never chmod-ed
    assert sorted(os.listdir(victims_dir)) == ["notes.txt"]  # nothing put there
    listing = gpuwatch("runs", env=env)
    assert listing.returncode == 1
    assert "symbolic link" in listing.stderr and "Traceback" not in listing.stderr


def test_a_squatted_run_directory_is_refused_with_a_clear_message(shared_tmp, other_user,
                                                                  tmp_path):
    default = shared_tmp / f"gpuwatch-{os.getuid()}"
    other_user.run("import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)",
                   str(default))
    env = job_env(TMPDIR=str(shared_tmp), GPUWATCH_RUN_DIR=None, XDG_RUNTIME_DIR=None,
                  GPUWATCH_LOG_DIR=str(tmp_path / "logs"))
    job = Job(env)
    try:
        assert job.started["run_file"] is None
        summary = job.stop()
    finally:
        job.kill()
    assert summary["steps"] >= 20
    assert any(f"belongs to uid {other_user.uid}" in e for e in summary["errors"]), summary
    assert os.listdir(default) == []  # no run file, no socket for the squatter
    for args in (("runs",), ("runs", "--json"), ("tail", "--json")):
        result = gpuwatch(*args, env=env)
        assert result.returncode == 1, args
        assert f"belongs to uid {other_user.uid}" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_run_files_are_never_read_through_links_fifos_or_from_other_owners(tmp_path,
                                                                           planter):
    directory = runs.private_dir(tmp_path / "runs")
    real = runs.RunInfo(run_id="real", rank=0, world_size=1, pid=os.getpid(),
                        pub_endpoint="ipc:///x", cmd_endpoint="", token="t",
                        started_at=1.0)
    runs.write_run_file(real, tmp_path)  # outside the run directory
    (directory / "linked.rank0.json").symlink_to(tmp_path / "real.rank0.json")
    os.mkfifo(directory / "fifo.rank0.json")  # reading it would block forever
    assert runs.list_runs(directory) == []


# --- V3: the run log -----------------------------------------------------------------

def test_the_run_log_is_never_written_through_a_link_or_a_hard_link(tmp_path):
    victims_file = tmp_path / "thesis.txt"
    victims_file.write_text("chapter 1\n")
    link = tmp_path / "run.rank0.jsonl"
    link.symlink_to(victims_file)
    with pytest.raises(UnsafeLogFileError, match="symbolic link"):
        RunLog(link)
    link.unlink()
    os.link(victims_file, link)
    with pytest.raises(UnsafeLogFileError, match="single link"):
        RunLog(link)
    link.unlink()
    os.mkfifo(link)
    with pytest.raises(OSError):  # no reader: refused at once, never blocks
        RunLog(link)
    assert victims_file.read_text() == "chapter 1\n"


def test_a_shared_log_directory_with_a_planted_link_is_refused(shared_tmp, planter,
                                                              tmp_path, run_dir):
    victims_file = tmp_path / "thesis.txt"
    victims_file.write_text("chapter 1\n")
    victims_file.chmod(0o644)
    run_id = "20250101-000000-v3v3"
    planter.run("import os, sys; os.symlink(sys.argv[1], sys.argv[2])",
                str(victims_file), str(shared_tmp / f"{run_id}.rank0.jsonl"))
    env = job_env(GPUWATCH_LOG_DIR=str(shared_tmp), GPUWATCH_RUN_ID=run_id)
    job = Job(env, min_steps=50)
    try:
        info = runs.find_run(run_id)
        assert info is not None and info.log_path == ""  # observed, without a log
        from gpuwatch.client import Subscriber

        with Subscriber(info) as subscriber:  # it says why, to whoever comes late
            hello = None
            while hello is None or hello["type"] != "hello":
                hello = subscriber.recv(timeout_s=30)
                assert hello is not None
        (error,) = hello["body"]["errors"]
        assert "run log" in error and "writable by other users" in error
        summary = job.stop()
    finally:
        job.kill()
    assert summary["steps"] >= 50
    assert victims_file.read_text() == "chapter 1\n"


# --- faults --------------------------------------------------------------------------

def test_a_log_directory_that_cannot_be_made_leaves_the_agent_observing(run_dir,
                                                                       monkeypatch):
    blocker = Path(run_dir) / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("GPUWATCH_LOG_DIR", str(blocker / "logs"))
    job = Job(job_env(), min_steps=50)
    try:
        info = runs.find_run()
        assert info is not None and info.pid == job.started["pid"]  # the run file is there
        from gpuwatch.client import Subscriber, send_command

        with Subscriber(info) as subscriber:
            kinds = set()
            while not {"step", "hello"} <= kinds:
                message = subscriber.recv(timeout_s=30)
                assert message is not None
                kinds.add(message["type"])
                if message["type"] == "hello":
                    (error,) = message["body"]["errors"]
                    assert error.startswith("gpuwatch agent: run log failed: ")
        assert send_command(info, "accum_steps", 2)["ok"]  # commands work too
        summary = job.stop()
    finally:
        job.kill()
    assert summary["accum_steps"] == 2
    assert [e for e in summary["errors"] if "run log" in e] == summary["errors"]
    assert len(summary["errors"]) == 1
    assert os.listdir(run_dir) == ["not-a-dir"]  # run file and sockets removed at exit


def test_socket_files_of_a_killed_run_are_removed_with_its_run_file(run_dir):
    job = Job(job_env())
    info = runs.find_run()
    sockets = [Path(endpoint[len("ipc://"):]) for endpoint in
               (info.pub_endpoint, info.cmd_endpoint)]
    assert all(stat.S_ISSOCK(os.lstat(path).st_mode) for path in sockets)
    job.process.send_signal(signal.SIGKILL)
    job.process.wait()
    assert Path(info.path).exists()  # a killed run leaves them behind ...
    assert runs.list_runs() == []  # ... and the next look cleans them
    assert not Path(info.path).exists()
    assert not any(path.exists() for path in sockets)

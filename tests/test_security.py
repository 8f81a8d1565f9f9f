"""Attacks from another local user, crafted logs and hostile agents, and the faults of
issue 11, each against real processes, sockets and terminals.

The other local user is a real unprivileged account (``gpuwatch-other``, created once
with ``useradd`` when missing, else ``nobody``), and its code runs in a child process
that drops to it with ``setpriv``: that needs root, so those tests are skipped with the
reason otherwise. From a clone in a private folder (mode 0700, as home folders often
are), that user gets a readable copy of what its code imports (``agent``, zmq, ...); where
it cannot even run this Python, those tests are skipped saying so. Attacks that one user
can stage alone (a link planted in one's own directory) run without root.
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
from typing import Iterator

import pytest

from agent.wire import protocol, runs
from agent.wire.runlog import RunLog, UnsafeLogFileError
from gpuwatch.history import flat_records
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
VICTIM = ROOT / "tests" / "victim_job.py"


# --- people and processes ------------------------------------------------------------

class User:
    """Runs Python code as a given local user (a child process); ``pythonpath``: where
    it finds ``agent`` and the packages it imports (this clone, or a readable copy)."""

    def __init__(self, uid: int, gid: int, pythonpath: str = str(ROOT)) -> None:
        self.uid, self.gid, self.pythonpath = uid, gid, pythonpath

    @property
    def foreign(self) -> bool:
        return self.uid != os.getuid()

    def command(self, code: str, *args: str) -> list[str]:
        prefix = ([shutil.which("setpriv"), f"--reuid={self.uid}", f"--regid={self.gid}",
                   "--clear-groups"] if self.foreign else [])
        return [*prefix, sys.executable, "-c", code, *map(str, args)]

    def env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": self.pythonpath,
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

    def launch(self, code: str, *args: str) -> Hostile:
        """Start a script that prints "ready" once under way, runs until its stdin
        closes, then prints one JSON line (tests/tcp_attack.py, tests/tcp_flood.py)."""
        return Hostile(self.start(code, *args))


class Hostile:
    """A script of :meth:`User.launch`, once it said "ready"; as a context, killed on
    leaving if it still runs."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        assert process.stdout.readline().strip() == "ready", process.stderr.read()

    def finish(self, timeout_s: float) -> dict:
        """Close its stdin; what it did (its JSON line), once it exited with 0."""
        self.process.stdin.close()
        result = json.loads(self.process.stdout.readline())
        assert self.process.wait(timeout_s) == 0
        return result

    def __enter__(self) -> Hostile:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()


@pytest.fixture(scope="session")
def other_user() -> Iterator[User]:
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
    user = User(entry.pw_uid, entry.pw_gid)
    if user_imports(user) is None:
        yield user
        return
    # a clone in a private folder (mode 0700, as home folders often are): a copy it can read
    copy = Path(tempfile.mkdtemp(prefix="gw-readable-"))
    try:
        user.pythonpath = str(readable_copy(copy))
        problem = user_imports(user)
        if problem is not None:
            pytest.skip(f"user {entry.pw_name} cannot run this Python or import what it "
                        f"needs even from a readable copy ({problem}): put the clone and "
                        "its Python where every user can read them to stage attacks from "
                        "another user")
        yield user
    finally:
        shutil.rmtree(copy, ignore_errors=True)


#: What the other user's code imports: tests/tcp_attack.py, tests/tcp_flood.py.
USER_IMPORTS = "import zmq, agent.wire.protocol"


def user_imports(user: User) -> str | None:
    """None if ``user`` can run this Python and :data:`USER_IMPORTS`, else the last line
    of what went wrong."""
    try:
        result = subprocess.run(user.command(USER_IMPORTS), env=user.env(), cwd="/",
                                capture_output=True, text=True, timeout=60)
    except OSError as exc:
        return str(exc)
    if result.returncode == 0:
        return None
    return (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]


def readable_copy(directory: Path) -> Path:
    """``directory``, made readable by every user, holding copies of the packages
    :data:`USER_IMPORTS` loads (this clone's ``agent``, zmq and the libraries beside it,
    msgpack, ...): what another user cannot read in a private folder."""
    listing = subprocess.run(  # {top-level package: its folder}, as that import loads them
        [sys.executable, "-c", f"{USER_IMPORTS}; import json, sys; print(json.dumps("
         "{name: list(module.__path__)[0] for name, module in list(sys.modules.items()) "
         "if '.' not in name and name not in sys.stdlib_module_names "
         "and getattr(module, '__path__', None)}))"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        check=True, timeout=60)
    for name, folder in json.loads(listing.stdout).items():
        package = Path(folder)
        shutil.copytree(package, directory / name, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        for libraries in package.parent.glob(f"*{name}.libs"):  # pyzmq.libs: libzmq
            shutil.copytree(libraries, directory / libraries.name, dirs_exist_ok=True)
    for path in (directory, *directory.rglob("*")):
        path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    return directory


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

    def __init__(self, env: dict[str, str], transport: str = "ipc", min_steps: int = 20,
                 max_files: int | None = None):
        """``max_files``: its (soft) limit on open files, as a default ``ulimit -n``
        would set it (its gateway inherits it)."""
        def limit() -> None:
            import resource

            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            soft = max_files if hard == resource.RLIM_INFINITY else min(max_files, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

        self.process = subprocess.Popen(
            [sys.executable, str(VICTIM), transport, str(min_steps)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, preexec_fn=limit if max_files else None)
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


# --- V4: terminal escape injection ---------------------------------------------------

#: What a hostile run or log writes: OSC 52 (sets the clipboard), a window title, a
#: screen clear, a C1 CSI and a right-to-left override, each with a marker after it.
EVIL = ("EVIL \x1b]52;c;UFdORUQ=\x07 \x1b]0;PWNED-TITLE\x07 \x1b[2JCLEARED "
        "\x9b2JC1 \u202eBIDI END")
#: Their raw bytes: none may reach a terminal.
RAW = (b"\x1b]52;", b"\x1b]0;PWNED", b"\x1b[2JCLEARED", b"\xc2\x9b", "\u202e".encode())


def assert_no_raw_sequences(output: bytes) -> None:
    for raw in RAW:
        assert raw not in output, f"{raw!r} reached the terminal"


def test_printable_shows_every_control_character_one_for_one():
    text = "".join(map(chr, [*range(0x20), 0x7F, *range(0x80, 0xA0)])) + \
        "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c" + \
        "\u2028\u2029\ud800 ok é 中"
    shown = protocol.printable(text)
    assert len(shown) == len(text) and shown.endswith(" ok é 中")
    assert shown.isprintable()
    assert shown[0x1B] == "␛" and shown[0x0A] == "␊" and shown[0x20] == "␡"
    assert protocol.printable(shown) == shown  # idempotent
    assert protocol.printable("a\nb", newlines=True) == "a\nb"
    assert protocol.printable("x" * 50, limit=10) == "x" * 9 + "…"
    plain = "step 12 loss 0.5"
    assert protocol.printable(plain) is plain  # the common case: no copy


def crafted_log(path: Path, run_id: str = "20250101-000000-evil") -> list[dict]:
    t = time.time()
    records = [
        {"type": "hello", "run": run_id, "rank": 0, "seq": 1, "t": t, "name": EVIL,
         "device": EVIL, "world_size": 1,
         "knobs": [{"name": "precision", "kind": "choice",
                    "choices": ["fp32", EVIL], "help": EVIL}]},
        {"type": "system", "run": run_id, "rank": 0, "seq": 2, "t": t, "cpu_pct": 1.0,
         "gpus": [], "gpu_status": EVIL},
        {"type": "step", "run": run_id, "rank": 0, "seq": 3, "t": t, "step": 1,
         "step_time_s": 0.01, "loss": 1.0, "knobs": {"precision": EVIL},
         "input_verdict": EVIL, "data_wait_share_window": 0.1},
        {"type": "event", "run": run_id, "rank": 0, "seq": 4, "t": t, "level": "error",
         "text": EVIL},
        {"type": "bye", "run": run_id, "rank": 0, "seq": 5, "t": t, "reason": EVIL,
         "steps": 1},
    ]
    with open(path, "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return records


def dashboard_output(terminal, until: bytes = b"PWNED-TITLE", timeout_s: float = 60,
                     poke=None):
    """Wait until the dashboard drew ``until`` (in its visible form), calling ``poke``
    every half second meanwhile (to say it again to a dashboard that came late), press
    q, and return everything it wrote to the terminal."""
    next_poke = 0.0

    def drawn():
        nonlocal next_poke
        if poke is not None and time.monotonic() >= next_poke:
            next_poke = time.monotonic() + 0.5
            poke()
        return until in terminal.output

    wait_until(drawn, f"the dashboard to draw {until!r}", timeout_s=timeout_s,
               alive=[terminal.process], detail=lambda: repr(bytes(terminal.output[-2000:])))
    terminal.type(b"q")
    assert terminal.process.wait(60) == 0
    return bytes(terminal.output)


def test_a_crafted_run_log_in_replay_writes_no_control_sequence(tmp_path, run_dir):
    from tests.test_end_to_end import Terminal

    path = tmp_path / "evil\x1b]0;PWNED-FILE\x07.jsonl"  # its name too
    crafted_log(path)
    terminal = Terminal("replay", str(path))
    try:
        output = dashboard_output(terminal)
    finally:
        terminal.close()
    assert_no_raw_sequences(output)
    assert b"\x1b]0;PWNED-FILE" not in output
    assert "␛".encode() in output and b"PWNED-TITLE" in output  # shown, as text


def test_a_hostile_agent_writes_no_control_sequence_to_the_live_dashboard(make_agent):
    from tests.test_end_to_end import Terminal

    agent = make_agent(knobs={"precision": EVIL, "accum_steps": 1},
                       step_fields={"input_verdict": EVIL},
                       run_id="20250101-000000-evil" + EVIL[:12])
    terminal = Terminal("20250101-000000-evil")
    try:
        output = dashboard_output(terminal, poke=lambda: agent.publish(
            "event", {"level": "warning", "text": EVIL}))
    finally:
        terminal.close()
    assert_no_raw_sequences(output)


def test_tail_runs_and_set_print_no_control_sequence(tmp_path, make_agent, run_dir):
    path = tmp_path / "evil.jsonl"
    records = crafted_log(path)
    human = subprocess.run([sys.executable, "-m", "gpuwatch", "tail", str(path)],
                           capture_output=True, timeout=60)
    assert human.returncode == 0, human.stderr
    assert_no_raw_sequences(human.stdout)
    assert "␛]0;PWNED-TITLE␇".encode() in human.stdout
    exact = subprocess.run([sys.executable, "-m", "gpuwatch", "tail", "--json", str(path)],
                           capture_output=True, timeout=60)
    assert [json.loads(line) for line in exact.stdout.splitlines()] == records  # exact
    assert_no_raw_sequences(exact.stdout)  # and the C1 CSI, the bidi override escaped

    agent = make_agent(knobs={"precision": EVIL, "accum_steps": 1}, refuse=EVIL)
    live = subprocess.run([sys.executable, "-m", "gpuwatch", "tail", "--count", "5",
                           agent.run_id], capture_output=True, timeout=60)
    assert live.returncode == 0, live.stderr
    assert b"precision=EVIL" in live.stdout
    assert_no_raw_sequences(live.stdout)
    refused = subprocess.run([sys.executable, "-m", "gpuwatch", "set", "accum_steps=2",
                              "--run", agent.run_id], capture_output=True, timeout=60)
    assert refused.returncode == 1 and b"EVIL" in refused.stderr
    assert_no_raw_sequences(refused.stdout + refused.stderr)
    named = runs.RunInfo(run_id="20250101-000000-name", rank=0, world_size=1,
                         pid=os.getpid(), pub_endpoint="ipc:///nowhere" + EVIL,
                         cmd_endpoint="", token="t", started_at=time.time(), name=EVIL)
    runs.write_run_file(named, Path(run_dir))
    listing = subprocess.run([sys.executable, "-m", "gpuwatch", "runs"],
                             capture_output=True, timeout=60)
    assert listing.returncode == 0 and b"EVIL" in listing.stdout
    assert_no_raw_sequences(listing.stdout)


# --- an unbounded dashboard ----------------------------------------------------------

#: The most memory the dashboard may take, whatever comes (issue 11).
DASHBOARD_RSS_LIMIT = 200 << 20


def test_the_state_keeps_bounded_texts_knobs_and_ranks(monkeypatch):
    from gpuwatch import state as state_module

    monkeypatch.setattr(state_module, "MAX_RANKS", 1024)  # the bound, at a size to flood
    state = state_module.RunState(primary_rank=0)
    huge = "x" * 1_000_000

    def envelope(msg_type, body, rank=0):
        return protocol.envelope(msg_type, body, run="r", rank=rank)

    state.ingest(envelope("hello", {"name": huge, "knobs": [
        {"name": f"k{i}", "kind": "int"} for i in range(10_000)] + [{"name": huge}],
        "env": {"deep": [[[[[[[[huge]]]]]]]], "wide": list(range(100_000))}}))
    state.ingest(envelope("event", {"level": "error", "text": huge}))
    state.ingest(envelope("step", {"step": 1, "knobs": {f"k{i}": huge for i in range(5000)}}))
    for rank in range(1, 5000):
        state.ingest(envelope("event", {"level": "warning", "text": huge}, rank=rank))
        state.ingest(envelope("step", {"step": 1, "step_time_s": 0.1,
                                       "knobs": {"a": huge}}, rank=rank))
    assert len(state.hello["name"]) == protocol.MAX_TEXT_CHARS
    assert len(state.schema) == state_module.MAX_KNOBS
    assert len(state.hello["env"]["wide"]) == state_module.MAX_ITEMS
    assert max(len(entry.text) for entry in state.events) <= protocol.MAX_TEXT_CHARS
    assert len(state.knobs) <= state_module.MAX_KNOBS
    assert all(len(value) <= protocol.MAX_TEXT_CHARS for value in state.knobs.values())
    assert 1024 <= len(state.ranks) <= state_module.MAX_RANKS + 1


class MemoryWatch:
    """The largest RSS of a process, sampled every 50 ms by a thread until stopped."""

    def __init__(self, pid: int) -> None:
        import threading

        import psutil

        self.peak = 0
        self._process = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import psutil

        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self._process.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def test_a_flood_of_1_mb_records_and_event_texts_keeps_the_dashboard_bounded(run_dir):
    from tests.test_end_to_end import Terminal

    run_id = "20250101-000000-flod"
    flood = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "flood_agent.py"), run_id, "1500",
         str(1_000_000)], env=job_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    terminal = None
    try:
        assert flood.stdout.readline().strip() == "ready"
        terminal = Terminal(run_id)
        memory = MemoryWatch(terminal.process.pid)
        # it is drawing the flood: its events (in the log, or the newest alone where the
        # log folds) or its 1 MB input verdict (cut to the panel)
        wait_until(lambda: b"FLOOD" in terminal.output or b"A" * 30 in terminal.output,
                   "the dashboard to draw the flood", timeout_s=120, alive=[terminal.process])
        assert flood.stdout.readline().startswith("flooded")  # 3 GB sent its way
        terminal.type(b"q")
        assert terminal.process.wait(60) == 0  # q is answered (no speed asserted)
        peak = memory.stop()
    finally:
        flood.stdin.close()
        flood.wait(30)
        if terminal is not None:
            terminal.close()
    print(f"dashboard RSS peaked at {peak / 2**20:.0f} MiB")
    assert peak < DASHBOARD_RSS_LIMIT, f"dashboard RSS peaked at {peak / 2**20:.0f} MiB"


def test_a_crafted_log_of_1_mb_event_texts_replays_bounded(tmp_path, run_dir):
    from tests.test_end_to_end import Terminal

    path = tmp_path / "big.jsonl"
    with open(path, "w") as handle:
        handle.write(json.dumps({"type": "hello", "run": "r", "rank": 0, "seq": 0,
                                 "t": time.time(), "name": "big", "knobs": []}) + "\n")
        for index in range(40):
            handle.write(json.dumps({"type": "event", "run": "r", "rank": 0,
                                     "seq": index + 1, "t": time.time(), "level": "info",
                                     "text": f"BIG{index} " + "B" * 1_000_000}) + "\n")
        handle.write(json.dumps({"type": "bye", "run": "r", "rank": 0, "seq": 41,
                                 "t": time.time(), "reason": "ALL-READ", "steps": 0}) + "\n")
    terminal = Terminal("replay", str(path))
    memory = MemoryWatch(terminal.process.pid)
    try:
        output = dashboard_output(terminal, until=b"ALL-READ")  # drawn after the rest
        peak = memory.stop()
    finally:
        terminal.close()
    assert output.count(b"B" * 1000) < 100  # what is drawn is cut
    print(f"dashboard RSS peaked at {peak / 2**20:.0f} MiB")
    assert peak < DASHBOARD_RSS_LIMIT, f"dashboard RSS peaked at {peak / 2**20:.0f} MiB"


def test_a_log_that_decompresses_to_200_times_its_size_is_read_in_bounded_memory(tmp_path):
    """A 1.4 MB run log of 8,000 events of 16 kB and 150 of 1 MB (278 MB once
    decompressed): each read of `tail` and replay holds a few MB of it, whatever the
    ratio and the records' size."""
    import tracemalloc

    from gpuwatch.sources.replay import RunLogReader

    path = tmp_path / "bomb.rank0.runlog"
    log = RunLog(path, flush_interval_s=0.0)
    log.write(protocol.envelope(protocol.HELLO, {"name": "bomb"}, run="bomb", seq=0, t=1e9))
    for seq in range(1, 8001):
        log.write(protocol.envelope(protocol.EVENT, {"level": "info", "text": "A" * 16_000},
                                    run="bomb", seq=seq, t=1e9 + seq))
    for seq in range(8001, 8151):
        log.write(protocol.envelope(protocol.EVENT, {"level": "info", "text": "B" * 1_000_000},
                                    run="bomb", seq=seq, t=1e9 + seq))
    log.close()
    assert path.stat().st_size < 1500 << 10
    tracemalloc.start()
    try:
        with RunLogReader(path) as reader:
            read = len(reader.read())
            first_peak = tracemalloc.get_traced_memory()[1]
            while not reader.at_eof:
                read += len(reader.read())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"peak {peak / 2**20:.1f} MiB, {first_peak / 2**20:.1f} MiB in the first read")
    assert read == 8151
    assert first_peak < 24 << 20, f"{first_peak / 2**20:.0f} MiB in one read"
    assert peak < 24 << 20, f"{peak / 2**20:.0f} MiB"


# --- V1: tcp on loopback -------------------------------------------------------------

def _hear(info: runs.RunInfo, msg_type: str, count: int) -> None:
    """The owner's dashboard (with the run's keys), newly subscribed to ``info``, hears
    ``count`` messages of ``msg_type``, each within 30 s."""
    from gpuwatch.client import Subscriber

    with Subscriber(info) as subscriber:
        seen = 0
        while seen < count:
            message = subscriber.recv(timeout_s=30)
            assert message is not None, f"the owner heard no {msg_type} message"
            seen += message["type"] == msg_type


@pytest.fixture
def intruder(request) -> User:
    """Another local user when the tests run as root, else this user without the run's
    keys (what CURVE refuses does not depend on who asks; how many connections the
    gateway lets in does: the tests that flood skip then)."""
    return request.getfixturevalue("planter")


#: tests/tcp_attack.py, run as the intruder (it needs nothing but agent.wire.protocol).
ATTACK = (ROOT / "tests" / "tcp_attack.py").read_text()


@pytest.mark.slow
def test_another_user_gets_nothing_from_a_tcp_run_and_costs_it_nothing(run_dir, intruder):
    import psutil

    from gpuwatch.client import send_command

    if not intruder.foreign:
        pytest.skip("connections are shared out per user: the attack from this same "
                    "user fills the owner's own share (and could read the run file "
                    "anyway); run the tests as root to attack from another user")
    job = Job(job_env(), transport="tcp", min_steps=100)
    try:
        info = runs.find_run()
        assert info.pub_endpoint.startswith("tcp://127.0.0.1:") and info.curve_server_key
        victim = psutil.Process(job.started["pid"])

        _hear(info, "heartbeat", 2)
        rss_before, fds_before = victim.memory_info().rss, victim.num_fds()
        with intruder.launch(ATTACK, info.pub_endpoint, info.cmd_endpoint,
                             run_dir) as attacker:
            _hear(info, "heartbeat", 3)  # the owner is served while all of it is held
            assert send_command(info, "accum_steps", 2)["ok"]
            rss_during, fds_during = victim.memory_info().rss, victim.num_fds()
            result = attacker.finish(60)
        summary = job.stop()
    finally:
        job.kill()
    assert result["received"] == 0 and result["replies"] == 0, result
    assert result["raw_connections"] > 0, result  # the ports were reachable
    if intruder.foreign:
        assert result["run_dir"] == "refused"  # and the run file unreadable
    assert fds_during - fds_before <= 2, (fds_before, fds_during)  # held by the gateway
    assert rss_during - rss_before < 30 << 20, (rss_before, rss_during)
    assert summary["accum_steps"] == 2 and summary["steps"] >= 100


def test_the_tcp_front_door_relays_and_lets_in_a_bounded_share(tmp_path):
    """agent.io.tcpfront, alone: bytes relayed both ways to its ipc socket; this user's
    connections let in up to the owner's share, the next one closed at once and never
    relayed; a slot freed is taken again."""
    import socket
    import threading

    from agent.io import tcpfront

    path = str(tmp_path / "echo")
    echo = socket.socket(socket.AF_UNIX)
    echo.bind(path)
    echo.listen(512)
    inside: list[socket.socket] = []

    def serve():
        while True:
            try:
                connection, _ = echo.accept()
            except OSError:
                return
            inside.append(connection)
            threading.Thread(target=lambda c=connection: [
                c.sendall(data) for data in iter(lambda: c.recv(65536), b"")],
                daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    door = tcpfront.TcpFront("127.0.0.1", [path]).start()
    clients = []
    try:
        first = socket.create_connection(("127.0.0.1", door.ports[0]), timeout=10)
        clients.append(first)
        payload = os.urandom(3 << 20)  # more than its buffers: it flows, it is not held
        threading.Thread(target=first.sendall, args=(payload,), daemon=True).start()
        got = bytearray()
        while len(got) < len(payload):
            got += first.recv(1 << 20)
        assert got == payload
        for _ in range(tcpfront.OWNER_CONNECTIONS - 1):
            clients.append(socket.create_connection(("127.0.0.1", door.ports[0]), 10))
        for client in clients:  # each one let in answers
            client.sendall(b"ping")
            assert client.recv(4) == b"ping"
        extra = socket.create_connection(("127.0.0.1", door.ports[0]), timeout=10)
        extra.sendall(b"ping")
        try:
            answer = extra.recv(4)
        except ConnectionResetError:  # closed before it read the ping
            answer = b""
        assert answer == b""  # closed at once, never relayed
        extra.close()
        assert len(inside) == tcpfront.OWNER_CONNECTIONS
        assert door.held() == {("uid", os.getuid()): tcpfront.OWNER_CONNECTIONS}
        clients.pop().close()
        wait_until(lambda: sum(door.held().values()) != tcpfront.OWNER_CONNECTIONS,
                   "the front to let a closed connection go", timeout_s=10, poll_s=0.01)
        again = socket.create_connection(("127.0.0.1", door.ports[0]), timeout=10)
        clients.append(again)
        again.sendall(b"ping")
        assert again.recv(4) == b"ping"
    finally:
        for client in clients:
            client.close()
        door.close()
        echo.close()
    assert door.refused == 1


#: A front door in a process that may open only 40 files, relaying to an echo socket.
SMALL_FRONT = r"""
import os, resource, socket, sys, threading
resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
from agent.io import tcpfront
echo = socket.socket(socket.AF_UNIX)
echo.bind(sys.argv[1])
echo.listen(512)
def serve(connection):
    for data in iter(lambda: connection.recv(65536), b""):
        connection.sendall(data)
    connection.close()
def accept():
    while True:
        try:
            connection, _ = echo.accept()
        except OSError:  # out of descriptors too: try again
            threading.Event().wait(0.05)
            continue
        threading.Thread(target=serve, args=(connection,), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
door = tcpfront.TcpFront("127.0.0.1", [sys.argv[1]]).start()
print(door.ports[0], flush=True)
sys.stdin.read()
"""


def test_a_front_door_out_of_descriptors_rests_instead_of_spinning(tmp_path):
    """When the process runs out of file descriptors the pending connections wait in the
    backlog and the listener rests (it does not spin on it), and it serves again once
    they are closed."""
    import socket

    import psutil

    front = subprocess.Popen([sys.executable, "-c", SMALL_FRONT, str(tmp_path / "echo")],
                             env=job_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    clients = []
    try:
        port = int(front.stdout.readline())
        for _ in range(40):  # far more than 40 files' worth
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        process = psutil.Process(front.pid)
        process.cpu_percent()
        time.sleep(2.0)
        busy = process.cpu_percent()
        for client in clients:  # (those still waiting in the backlog too)
            client.close()
        clients.clear()
        last = socket.create_connection(("127.0.0.1", port), timeout=10)
        clients.append(last)
        last.sendall(b"ping")
        last.settimeout(20)
        assert last.recv(4) == b"ping"  # served again
    finally:
        for client in clients:
            client.close()
        front.stdin.close()
        front.wait(30)
    assert busy < 50, f"{busy}% of a core while out of descriptors"


#: tests/tcp_flood.py: raw connections held open, each one closed replaced at once.
FLOOD = (ROOT / "tests" / "tcp_flood.py").read_text()


@pytest.mark.slow
def test_another_users_connections_cannot_exhaust_the_runs_descriptors(run_dir, intruder):
    """1,500 raw connections held against a run whose limit is 1,024 open files (each
    one closed replaced at once): the training process's own open() keeps working, its
    gateway holds a few of them (another user's share), and the owner is served."""
    import psutil

    from agent.io import tcpfront
    from gpuwatch.client import send_command

    if not intruder.foreign:
        pytest.skip("connections are shared out per user: a flood from this same user "
                    "fills the owner's own share (and could read the run file anyway); "
                    "run the tests as root to flood from another user")
    job = Job(job_env(), transport="tcp", min_steps=50, max_files=1024)
    try:
        info = runs.find_run()
        victim = psutil.Process(job.started["pid"])
        (gateway,) = [child for child in victim.children() if _is_gateway(child)]

        _hear(info, "heartbeat", 1)
        fds_before = victim.num_fds(), gateway.num_fds()
        ports = ",".join(endpoint.rsplit(":", 1)[1]
                         for endpoint in (info.pub_endpoint, info.cmd_endpoint))
        with intruder.launch(FLOOD, "127.0.0.1", ports, "1500", "60") as flood:
            fds_during = victim.num_fds(), gateway.num_fds()
            _hear(info, "heartbeat", 2)  # a new subscription, let in while it goes on
            assert send_command(info, "accum_steps", 2)["ok"]
            fds_during = tuple(map(max, fds_during, (victim.num_fds(), gateway.num_fds())))
            result = flood.finish(30)
        summary = job.stop()
    finally:
        job.kill()
    assert result["most_held"] >= 1500 and result["opened"] > 1500, result
    assert fds_during[0] - fds_before[0] <= 2, (fds_before, fds_during)
    # each connection let in: 3 descriptors; the owner's dashboard, command, a few more
    assert fds_during[1] - fds_before[1] <= 3 * tcpfront.PEER_CONNECTIONS + 12, (
        fds_before, fds_during)
    assert summary["open_errors"] == 0 and summary["errors"] == [], summary
    assert summary["accum_steps"] == 2 and summary["steps"] >= 50


def test_another_users_connections_cannot_exhaust_a_node_relays_descriptors(
        run_dir, tmp_path, monkeypatch, intruder):
    """The same flood against a multi-node job's relay (a real ``python -m agent.io.relay``
    in front of node 1's ranks): it holds a few of them (another user's share), and the
    owner's dashboard, with the job secret's keys, still hears the node's summaries."""
    import psutil

    from agent.wire import nodes
    from agent.io import tcpfront
    from tests.test_nodes import RUN_ID, OtherNode

    if not intruder.foreign:
        pytest.skip("connections are shared out per user: run the tests as root to "
                    "flood from another user")
    monkeypatch.setenv(nodes.SECRET_ENV, str(tmp_path / "secret"))
    nodes.create_secret(tmp_path / "secret")
    secret = nodes.load_secret(tmp_path / "secret")
    other = OtherNode(tmp_path / "node1", secret, {})
    public, private = nodes.client_keys(secret, RUN_ID)
    dashboard = runs.RunInfo(run_id=RUN_ID, rank=2, world_size=4, pid=0,
                             pub_endpoint=other.entry["pub_endpoint"],
                             cmd_endpoint=other.entry["cmd_endpoint"], token="",
                             started_at=0.0, curve_server_key=other.entry["server_key"],
                             curve_client_public_key=public,
                             curve_client_secret_key=private)
    try:
        relay = psutil.Process(other.process.pid)

        _hear(dashboard, protocol.NODE, 1)
        fds_before = relay.num_fds()
        ports = ",".join(other.entry[key].rsplit(":", 1)[1]
                         for key in ("pub_endpoint", "cmd_endpoint"))
        with intruder.launch(FLOOD, "127.0.0.1", ports, "1500", "60") as flood:
            _hear(dashboard, protocol.NODE, 2)  # a new subscription, let in while it goes on
            fds_during = relay.num_fds()
            result = flood.finish(30)
    finally:
        other.stop()
    assert result["most_held"] >= 1500 and result["opened"] > 1500, result
    assert fds_during - fds_before <= 3 * tcpfront.PEER_CONNECTIONS + 12, (
        fds_before, fds_during)


#: With the run's keys (this user's own process): a 4 MB subscription, kept up until
#: stdin closes (then os._exit: ZeroMQ crashes closing a SUB of megabytes).
HUGE_SUBSCRIPTION = r"""
import os, sys, zmq
from agent.wire import runs
from gpuwatch.client import secure
info = runs.find_run()
sub = zmq.Context.instance().socket(zmq.SUB)
secure(sub, info)
sub.setsockopt(zmq.SUBSCRIBE, b"x" * (4 << 20))
sub.connect(info.pub_endpoint)
print("subscribed", flush=True)
sys.stdin.read()
os._exit(0)
"""


def _is_gateway(process) -> bool:
    """Whether a child of the job is its tcp gateway (not, e.g., an unreaped child of
    the environment report)."""
    import psutil

    try:
        return "agent.io.gateway" in process.cmdline()
    except psutil.Error:  # a zombie, or gone
        return False


@pytest.mark.slow
def test_even_with_the_runs_keys_a_huge_subscription_is_not_held(run_dir):
    import psutil

    from gpuwatch.client import Subscriber

    job = Job(job_env(), transport="tcp", min_steps=10)
    huge = None
    try:
        victim = psutil.Process(job.started["pid"])
        (gateway,) = [child for child in victim.children() if _is_gateway(child)]
        with Subscriber(runs.find_run()) as subscriber:
            def heartbeats(count):
                for _ in range(count):
                    while subscriber.recv(timeout_s=30)["type"] != "heartbeat":
                        pass

            heartbeats(1)
            before = victim.memory_info().rss, gateway.memory_info().rss
            huge = subprocess.Popen([sys.executable, "-c", HUGE_SUBSCRIPTION],
                                    env=job_env(), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
            assert huge.stdout.readline().strip() == "subscribed"
            heartbeats(3)  # it is cut off, and tries again, meanwhile
            after = victim.memory_info().rss, gateway.memory_info().rss
        huge.stdin.close()
        assert huge.wait(30) == 0
        job.stop()
    finally:
        if huge is not None and huge.poll() is None:
            huge.kill()
        job.kill()
    grown = [(a - b) >> 20 for a, b in zip(after, before)]
    assert max(grown) < 20, f"training process, gateway grew {grown} MiB"


@pytest.mark.slow
def test_resubscribing_in_a_loop_neither_fills_the_run_log_nor_floods_the_wire(run_dir):
    import zmq

    from gpuwatch.client import Subscriber

    job = Job(job_env(), min_steps=10)
    try:
        info = runs.find_run()
        with Subscriber(info) as watcher:
            while (message := watcher.recv(timeout_s=30))["type"] != "step":
                pass
            churn = zmq.Context.instance().socket(zmq.SUB)
            churn.setsockopt(zmq.LINGER, 0)
            churn.connect(info.pub_endpoint)
            started = time.monotonic()
            for _ in range(20_000):  # 20,000 new subscriptions
                churn.setsockopt(zmq.SUBSCRIBE, b"")
                churn.setsockopt(zmq.UNSUBSCRIBE, b"")
            churn.setsockopt(zmq.SUBSCRIBE, b"")
            hellos = 0
            while (message := watcher.recv(timeout_s=30))["type"] != "heartbeat" or \
                    message["body"]["step"] < 30 or time.monotonic() - started < 2:
                hellos += message["type"] == "hello"
            elapsed = time.monotonic() - started
            churn.close()
        job.stop()
    finally:
        job.kill()
    bound = 2 * elapsed + 2 + elapsed / 30  # GREETINGS_PER_S, the one due, periodic ones
    assert hellos <= bound, (hellos, elapsed)
    logged = [record["type"] for record in flat_records(job.started["log_path"])]
    assert logged.count("hello") <= 2 + elapsed / 30, logged.count("hello")


#: Takes the ports of a run that ended (without its keys), publishes "live" steps and
#: watches what connects: prints "bound", then on stdin's end what its sockets saw.
SQUAT = r"""
import json, sys, time, zmq
from agent.wire import protocol
pub_port, cmd_port = int(sys.argv[1]), int(sys.argv[2])
context = zmq.Context()
pub, router = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
for sock, port in ((pub, pub_port), (router, cmd_port)):
    sock.setsockopt(zmq.LINGER, 0)
    deadline = time.monotonic() + 30
    while True:
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
monitor = pub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
print("bound", flush=True)
seen = {"accepted": 0, "handshakes": 0, "commands": 0}
poller = zmq.Poller()
for sock in (monitor, router):
    poller.register(sock, zmq.POLLIN)
poller.register(sys.stdin.fileno(), zmq.POLLIN)
step = 10 ** 6
while True:
    ready = dict(poller.poll(20))
    if sys.stdin.fileno() in ready:
        break
    step += 1
    pub.send_multipart(protocol.encode(protocol.envelope(
        "step", {"step": step, "step_time_s": 0.01}, run=sys.argv[3], seq=step)))
    if monitor in ready:
        from zmq.utils.monitor import recv_monitor_message
        event = recv_monitor_message(monitor)["event"]
        key = "accepted" if event == zmq.EVENT_ACCEPTED else "handshakes"
        seen[key] += 1
        if key == "accepted" and seen["accepted"] == 1:
            print("knocked", flush=True)
    if router in ready:
        router.recv_multipart()
        seen["commands"] += 1
print(json.dumps(seen), flush=True)
"""


def test_a_dashboard_never_trusts_a_port_taken_over_after_its_run_ended(make_agent,
                                                                        intruder):
    from gpuwatch.client import send_command
    from gpuwatch.sources.live import LiveSource

    agent = make_agent()
    source = LiveSource(agent.info)
    source.start()
    squatter = None
    try:
        def stepped():
            with source.lock:
                return source.state.step

        wait_until(stepped, "the dashboard's first step", timeout_s=30)
        pub_port = int(agent.info.pub_endpoint.rsplit(":", 1)[1])
        cmd_port = int(agent.info.cmd_endpoint.rsplit(":", 1)[1])
        agent.stop()  # the run ends; its ports are free
        squatter = intruder.start(SQUAT, str(pub_port), str(cmd_port), agent.run_id)
        assert squatter.stdout.readline().strip() == "bound", squatter.stderr.read()
        assert squatter.stdout.readline().strip() == "knocked"  # the dashboard came by
        reply = send_command(source.info, "precision", "bf16", timeout_s=1.0)
        squatter.stdin.close()
        seen = json.loads(squatter.stdout.readline())
        with source.lock:
            step = source.state.step
    finally:
        source.close()
        if squatter is not None and squatter.poll() is None:
            squatter.kill()
    assert reply["ok"] is False and reply["answered"] is False
    assert seen["handshakes"] == 0 and seen["commands"] == 0, seen  # no token left
    assert step < 10 ** 6  # no fake step was shown


# --- more faults ---------------------------------------------------------------------

@pytest.mark.slow
def test_tail_of_a_killed_run_and_of_an_unreachable_endpoint_ends_saying_so(run_dir):
    job = Job(job_env())
    try:
        info = runs.find_run()
        tail = subprocess.Popen([sys.executable, "-m", "gpuwatch", "tail", "--run",
                                 info.run_id], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert tail.stdout.readline()  # it is following the run
        job.process.send_signal(signal.SIGKILL)
        job.process.wait()
        _, error = tail.communicate(timeout=60)
    finally:
        job.kill()
    assert tail.returncode == 1
    assert f"run {info.run_id} is gone: its process (pid {info.pid}) ended" in error
    nowhere = gpuwatch("tail", f"ipc://{run_dir}/nobody-here")
    assert nowhere.returncode == 1
    assert "nothing heard from ipc://" in nowhere.stderr, nowhere.stderr


def test_a_huge_knob_name_is_not_echoed_and_heartbeats_count_rejections(run_dir):
    from gpuwatch.client import Subscriber, send_command

    job = Job(job_env(), min_steps=10)
    try:
        info = runs.find_run()
        with Subscriber(info) as subscriber:
            while subscriber.recv(timeout_s=30)["type"] != "heartbeat":
                pass
            reply = send_command(info, "k" * 60_000, 1)
            event = heartbeat = None
            while event is None or heartbeat is None:
                message = subscriber.recv(timeout_s=30)
                assert message is not None
                if message["type"] == "event" and message["body"].get("kind") == "rejected":
                    event = message["body"]
                if message["type"] == "heartbeat" and message["body"].get(
                        "commands_rejected"):
                    heartbeat = message["body"]
        job.stop()
    finally:
        job.kill()
    assert reply["ok"] is False and reply["reason"].startswith("unknown knob 'kkk")
    assert len(reply["reason"]) <= protocol.MAX_TEXT_CHARS
    assert len(reply.get("knob") or "") <= protocol.MAX_NAME_CHARS
    assert len(event["text"]) <= protocol.MAX_TEXT_CHARS + 100
    assert len(event.get("knob") or "") <= protocol.MAX_NAME_CHARS
    assert heartbeat["commands_rejected"] == 1


# --- liveness on a loaded machine ----------------------------------------------------

@pytest.mark.slow
def test_a_run_on_a_loaded_machine_is_never_reported_gone(run_dir):
    """CPU burners beside the run (load ~4 a core), and in the middle the run gets no
    CPU at all for 5 s (SIGSTOP, then SIGCONT: the worst a loaded machine does to a
    heartbeat); the dashboard's state is looked at all along."""
    from gpuwatch.sources.live import LiveSource

    job = Job(job_env(), min_steps=10)
    burners = []
    source = None

    def watch(statuses, seconds):
        """Sample the status until the run's own clock moved ``seconds``."""
        began = told = None
        deadline = time.monotonic() + 300
        while began is None or told is None or told - began < seconds:
            assert time.monotonic() < deadline
            time.sleep(0.05)
            with source.lock:
                statuses.append(source.state.status_at(time.monotonic()))
                told = source.state.message_t
            began = began or told

    try:
        source = LiveSource(runs.find_run())
        source.start()
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                   for _ in range(4 * min(os.cpu_count() or 2, 8))]
        statuses: list[str] = []
        watch(statuses, 3)
        job.process.send_signal(signal.SIGSTOP)
        frozen_until = time.monotonic() + 5
        while time.monotonic() < frozen_until:  # the length of the freeze is the point
            time.sleep(0.05)
            with source.lock:
                statuses.append(source.state.status_at(time.monotonic()))
        job.process.send_signal(signal.SIGCONT)
        watch(statuses, 5)
        for burner in burners:
            burner.kill()
            burner.wait()

        def status() -> str:
            with source.lock:
                return source.state.status_at(time.monotonic())

        # Steps may lag the heartbeats under the burners ("stalled" is no error); with
        # the CPU back the run is live again.
        statuses.append(wait_until(lambda: status() == "live" and "live",
                                   "the run live again once the burners stop",
                                   timeout_s=60, poll_s=0.05))
        summary = job.stop()
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        if source is not None:
            source.close()
        if job.process.poll() is None:
            job.process.send_signal(signal.SIGCONT)
        job.kill()
    assert "gone" not in statuses and "quiet" not in statuses, sorted(set(statuses))
    assert statuses[-1] == "live"
    assert summary["steps"] > 10


# --- rewind: a checkpoint another user wrote, or can swap ------------------------------

def _saved_loop(tmp_path: Path):
    """A hand-written loop (tests/test_rewind.py) with its checkpoint of step 3 saved in
    ``tmp_path/mine`` (0700, this user's), trained to step 4; and that checkpoint's path."""
    from tests.test_rewind import Loop

    loop = Loop(tmp_path / "mine")
    loop.train(2)
    assert loop.send("checkpoint", "now")["ok"]
    loop.train(2)
    return loop, tmp_path / "mine" / "step-00000003.pt"


def _refused(loop, refused: dict[str, str]) -> None:
    """Each ``rewind=<path>`` of ``refused`` is refused at once with its words."""
    for value, words in refused.items():
        reply = loop.send("rewind", value)
        assert not reply["ok"] and words in reply["reason"], (value, reply)


def test_a_rewind_reads_no_checkpoint_another_user_wrote_or_can_swap(run_dir, tmp_path,
                                                                      shared_tmp,
                                                                      other_user):
    """Another local user plants checkpoints (real ones of this run's format, weights of
    its choice) in a /tmp-like directory: its own file, this user's file in its own
    folder, a folder of a group it is in; the owner's ``rewind=<path>`` to any of them
    is refused at once, naming who could swap it, and the run stays on branch 0. A link
    it planted to the owner's folder is read through its target (a link swapped later
    changes nothing)."""
    loop, saved = _saved_loop(tmp_path)
    source = shared_tmp / "source.pt"  # (a copy the other user can read)
    shutil.copy(saved, source)
    source.chmod(0o644)
    other_user.run(
        "import os, shutil, sys\n"
        "source, tmp, mine = map(sys.argv.__getitem__, (1, 2, 3))\n"
        "shutil.copy(source, tmp + '/theirs.pt')\n"
        "for folder, mode in (('theirs', 0o755), ('open', 0o777)):\n"
        "    os.mkdir(tmp + '/' + folder); os.chmod(tmp + '/' + folder, mode)\n"
        "shutil.copy(source, tmp + '/theirs/step.pt')\n"
        "os.symlink(mine, tmp + '/link')\n",
        str(source), str(shared_tmp), str(saved.parent))
    theirs = other_user.uid
    shutil.copy(saved, shared_tmp / "open" / "mine.pt")  # this user's file, their folder
    group = tmp_path / "group"
    group.mkdir()
    shutil.copy(saved, group / "mine.pt")
    os.chown(group, -1, other_user.gid)
    group.chmod(0o770)
    _refused(loop, {
        str(shared_tmp / "theirs.pt"): f"belongs to uid {theirs}, another user",
        str(shared_tmp / "theirs" / "step.pt"): f"{shared_tmp / 'theirs'} belongs to uid",
        str(shared_tmp / "open" / "mine.pt"): f"{shared_tmp / 'open'} belongs to uid",
        str(group / "mine.pt"): f"other users can write in {group} (mode 0770)",
    })
    deeper = shared_tmp / "theirs" / "mine"  # this user's folder in theirs
    deeper.mkdir(mode=0o700)
    shutil.copy(saved, deeper / "mine.pt")
    assert loop.send("rewind", str(deeper / "mine.pt"))["ok"]  # (a command's check: the
    loop.train(1)  # checkpoint and its folder; the whole path before the read)
    assert loop.run.branch == 0
    assert loop.send("rewind", str(shared_tmp / "link" / saved.name))["ok"]
    loop.train(1)
    assert loop.run.branch == 1 and loop.run.step == 3
    records = loop.records()
    [failed] = [r for r in records if r.get("kind") == "failed"]
    assert (f"{shared_tmp / 'theirs'} belongs to uid {theirs}, another user"
            in failed["text"]), failed
    [branched] = [r for r in records if r.get("kind") == "branched"]
    assert branched["source"] == str(saved), branched  # read through the link's target


def test_a_rewind_reads_nothing_in_reach_of_other_users(run_dir, tmp_path):
    """What one user stages alone: a checkpoint in a folder every user can write (no
    sticky bit), one every user can write itself: each ``rewind`` is refused at once with
    the reason; a checkpoint folder holding a symlink: where it applies (its entries
    are looked at before the read, not by a command's check)."""
    loop, saved = _saved_loop(tmp_path)
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    shutil.copy(saved, open_folder / "mine.pt")
    open_folder.chmod(0o777)
    writable = tmp_path / "writable.pt"
    shutil.copy(saved, writable)
    writable.chmod(0o666)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "model.pt").symlink_to(saved)
    _refused(loop, {
        str(open_folder / "mine.pt"): f"other users can write in {open_folder} (mode 0777)",
        str(writable): f"other users can write {writable} (mode 0666)",
    })
    assert loop.send("rewind", str(folder))["ok"]
    loop.train(2)
    assert loop.run.branch == 0 and loop.run.step == 6
    [failed] = [r for r in loop.records() if r.get("kind") == "failed"]
    assert f"{folder / 'model.pt'} is a symlink, which is not followed" in failed["text"]


# --- checkpoints saved where other users can write -----------------------------------

#: Run as another user: links planted where the owner's checkpoint of step ``STEP`` is
#: written (``.step-<STEP>.pt.tmp-<PID>``, the temporary name of earlier versions), each
#: one put back as soon as the directory changes (inotify: the owner removed it, or made
#: a temporary of its own), pointing at ``TARGET``; prints "ready", then, once stdin
#: closes, one JSON line: ``{"planted": N}``.
#:     python -c RACER DIR PID STEP TARGET
RACER = r"""
import ctypes, json, os, select, struct, sys
folder, pid, step, target = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
names = {f".step-{step:08d}.pt.tmp-{pid}"}
planted = 0
def plant(name):
    global planted
    try:
        os.symlink(target, os.path.join(folder, name))
        planted += 1
    except OSError:
        pass
libc = ctypes.CDLL(None, use_errno=True)
watch = libc.inotify_init1(os.O_NONBLOCK)
libc.inotify_add_watch(watch, folder.encode(), 0x100 | 0x200)  # IN_CREATE | IN_DELETE
for name in names:
    plant(name)
print("ready", flush=True)
while True:
    ready, _, _ = select.select([watch, sys.stdin], [], [])
    if sys.stdin in ready:
        break
    data = os.read(watch, 65536)
    at = 0
    while at < len(data):
        _, mask, _, length = struct.unpack_from("iIII", data, at)
        name = data[at + 16:at + 16 + length].rstrip(b"\0").decode()
        at += 16 + length
        if ".tmp-" in name:
            names.add(name)
            for known in names:
                plant(known)  # (another user's name: refused in a sticky directory)
                plant(os.path.join(known, f"step-{step:08d}.pt"))  # inside its folder
print(json.dumps({"planted": planted}), flush=True)
"""


def test_a_checkpoint_in_a_shared_directory_is_never_written_through_a_planted_link(
        run_dir, tmp_path, shared_tmp, planter):
    """A hand-written loop saves its checkpoints in a /tmp-like directory (world-writable,
    sticky) while another local user keeps a link planted at every temporary name it can
    see or guess, put back the moment the owner removes it: the owner's file the links
    point at is as it was, and the checkpoint is a file of its own that loads."""
    from agent.control.checkpoints import load_checkpoint
    from tests.test_rewind import Loop

    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"the owner's file")
    precious.chmod(0o644)
    loop = Loop(shared_tmp)
    with planter.launch(RACER, str(shared_tmp), str(os.getpid()), "3",
                        str(precious)) as racer:
        loop.train(2)
        assert loop.send("checkpoint", "now")["ok"]
        loop.train(2)  # saved after step 3
        result = racer.finish(30)
    records = loop.records()
    assert precious.read_bytes() == b"the owner's file", result
    assert stat.S_IMODE(precious.stat().st_mode) == 0o644
    [applied] = [r for r in records if r.get("kind") == "applied"
                 and r.get("knob") == "checkpoint"]
    saved = Path(applied["path"])
    assert saved.parent == shared_tmp and not saved.is_symlink()
    assert stat.S_IMODE(saved.lstat().st_mode) == 0o600
    assert load_checkpoint(saved)["step"] == 3
    assert result["planted"] >= 1, result
    assert [p.name for p in shared_tmp.iterdir() if not p.is_symlink()] == [saved.name]


def test_a_checkpoint_is_never_written_where_another_user_could_swap_it(run_dir, tmp_path,
                                                                        planter):
    """A ``checkpoint_dir`` every user can write without the sticky bit, one below such a
    directory, and (as root) one of another user's: the save is refused with the reason
    and nothing is written there; the run trains on."""
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    refused = {open_folder: f"other users can write in {open_folder} (mode 0777)",
               open_folder / "below": f"other users can write in {open_folder} (mode 0777)"}
    if planter.foreign:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, planter.uid, planter.gid)
        refused[theirs / "deeper"] = f"{theirs} belongs to uid {planter.uid}, another user"
    from tests.test_rewind import Loop

    for folder, words in refused.items():
        loop = Loop(folder)
        loop.train(2)
        assert loop.send("checkpoint", "now")["ok"]
        loop.train(2)
        records = loop.records()
        [failed] = [r for r in records if r.get("kind") == "failed"
                    and r.get("knob") == "checkpoint"]
        assert words in failed["text"], (folder, failed)
        assert sum(r["type"] == "step" for r in records) == 4
        assert not folder.exists() or list(folder.iterdir()) == [], folder


# --- rewind: a checkpoint with a pickle payload ----------------------------------------

class Payload:
    """Runs code when unpickled: makes the directory ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.marker,))


def _poison(checkpoint: Path, marker: Path) -> int:
    """Put a :class:`Payload` beside the contents of every ``torch.save`` file of
    ``checkpoint`` (a file, or a directory's files); returns how many were poisoned."""
    import zipfile

    import torch

    poisoned = 0
    for path in [checkpoint] if checkpoint.is_file() else sorted(checkpoint.rglob("*")):
        if path.is_file() and zipfile.is_zipfile(path):
            contents = torch.load(path, weights_only=False)  # (ours: trusted)
            if isinstance(contents, dict):
                contents["payload"] = Payload(marker)
                torch.save(contents, path)
                poisoned += 1
    return poisoned


def _one_driver_each() -> list:
    from tests.contract import all_drivers

    return [pytest.param(driver, id=driver.name) for driver in all_drivers()
            if "-" not in driver.name]


@pytest.mark.parametrize("driver", _one_driver_each())
def test_a_rewind_runs_no_code_from_a_checkpoint(driver, run_dir, tmp_path, monkeypatch):
    """Every integration's checkpoint with a pickle payload in each of its
    ``torch.save`` files: ``rewind`` to it fails where it applies, no code runs, and the
    training goes on on branch 0; even with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (set
    to load old checkpoints), which turns every ``torch.load`` not told
    ``weights_only=True`` into a full unpickler."""
    from tests.contract import Recorder, run

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    first = run(driver, steps=4, commands=[("checkpoint", "now", 4)],
                checkpoint_dir=tmp_path / "first")
    [saved] = [Path(e["path"]) for e in first.events("applied") if e["knob"] == "checkpoint"]
    crafted = tmp_path / "crafted"
    if saved.is_dir():
        shutil.copytree(saved, crafted)
    else:
        shutil.copy2(saved, crafted)
    marker = tmp_path / "PWNED"
    assert _poison(crafted, marker) >= 1
    recorder = Recorder(later=[(2, "rewind", str(crafted), 4)])
    second = run(driver, steps=6, commands=[], checkpoint_dir=tmp_path / "second",
                 recorder=recorder)
    assert recorder.replies["rewind"]["ok"], recorder.replies["rewind"]
    assert not marker.exists(), "code from the checkpoint ran"
    [failed] = [e for e in second.events("failed") if e["knob"] == "rewind"]
    assert failed["step"] == 4, failed
    assert not second.events("branched")
    assert sorted(second.steps()) == list(range(1, 7))


class _Counter:
    """An object of the loop's own, registered with ``accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


@pytest.mark.parametrize("registered", ["before attach", "after attach"])
def test_accelerate_refuses_a_rewind_while_it_would_unpickle_registered_objects(
        registered, run_dir, tmp_path):
    """accelerate loads the states of objects registered for checkpointing with
    ``weights_only=False``: while one is registered (before ``agent.attach``, or once
    training is under way), ``rewind`` is refused at once with the reason, and no code
    from a checkpoint's ``custom_checkpoint_0.pkl`` runs."""
    from tests.contract import Recorder, run
    from tests.contract.accelerate import AccelerateDriver

    class Registering(AccelerateDriver):
        at_start = True

        def data(self, accelerator):
            self.accelerator = accelerator
            if self.at_start:
                accelerator.register_for_checkpointing(_Counter())
            return super().data(accelerator)

    class RegisteringAtFirstBatch(Recorder):
        def micro_batch(self, index):
            if not driver.accelerator._custom_objects:
                driver.accelerator.register_for_checkpointing(_Counter())
            super().micro_batch(index)

    driver = Registering()
    first = run(driver, steps=4, commands=[("checkpoint", "now", 4)],
                checkpoint_dir=tmp_path / "first")
    [saved] = [Path(e["path"]) for e in first.events("applied") if e["knob"] == "checkpoint"]
    marker = tmp_path / "PWNED"
    assert _poison(saved / "custom_checkpoint_0.pkl", marker) == 1
    later = [(2, "rewind", str(saved), 4)]
    if registered == "before attach":
        recorder = Recorder(later=later)
    else:
        driver.at_start, recorder = False, RegisteringAtFirstBatch(later=later)
    second = run(driver, steps=6, commands=[], checkpoint_dir=tmp_path / "second",
                 recorder=recorder)
    reply = recorder.replies["rewind"]
    assert not reply["ok"] and "register_for_checkpointing" in reply["reason"], reply
    assert not marker.exists(), "code from the checkpoint ran"
    assert not second.events("branched")


def test_a_sharded_checkpoint_runs_no_code_from_its_metadata(tmp_path):
    """``torch.distributed.checkpoint`` reads a directory's ``.metadata`` with a full
    ``pickle.load``; ``load_sharded`` (the rewind and resume of a model ``fully_shard``
    wrapped, e.g. Fabric's on one process) reads it naming nothing but the metadata's
    classes: a real one loads back bit for bit, one with a payload runs no code."""
    import pickle

    import torch
    import torch.distributed as dist

    from agent.control.checkpoints import FORMAT
    from agent.integrations.sharded import load_sharded, save_sharded

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        saved = tmp_path / "sharded"
        save_sharded(saved, model, optimizer, lambda: {"format": FORMAT, "world_size": 1,
                                                       "step": 1, "knobs": {}})
        want = [parameter.detach().clone() for parameter in model.parameters()]
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()
        assert load_sharded(saved, model, optimizer)["step"] == 1
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(model.parameters(), want))
        marker = tmp_path / "PWNED"
        (saved / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        with pytest.raises(BaseException) as error:
            load_sharded(saved, model, optimizer)
        assert not marker.exists(), "code from the checkpoint ran"
        # a ValueError, not torch's CheckpointException (a BaseException no caller catches)
        assert error.type is ValueError, error.type
        assert "the checkpoint's metadata names posix.mkdir" in str(error.value)
        assert "Traceback" not in str(error.value)
    finally:
        dist.destroy_process_group()


def test_a_sharded_checkpoint_that_cannot_be_written_raises_os_error(tmp_path):
    """``torch.distributed.checkpoint`` reports a failure as its CheckpointException, a
    BaseException: ``save_sharded`` says it as the OSError it documents (every rank
    hears of it at its last collective), not as something no caller catches."""
    import torch
    import torch.distributed as dist

    from agent.control.checkpoints import FORMAT
    from agent.integrations.sharded import save_sharded

    (tmp_path / "a-file").write_text("not a directory")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 3)
        with pytest.raises(BaseException) as error:
            save_sharded(tmp_path / "a-file" / "sharded", model, None,
                         lambda: {"format": FORMAT, "world_size": 1, "step": 1, "knobs": {}})
        assert error.type is OSError, error.type
        assert str(error.value).startswith("the sharded checkpoint failed on rank 0"), error
    finally:
        dist.destroy_process_group()


def test_a_script_clients_errors_carry_no_control_sequence(run_dir, tmp_path):
    """A rewind to a crafted file fails where it applies with torch's reason, which
    quotes the file (a global named with escape sequences) and has its own bold ones:
    ``RunClient.set`` raises CommandError with them shown as text, for a script that
    prints it (the steer example does); its ``body`` keeps the event as sent."""
    from gpuwatch.client import CommandError, RunClient

    loop, _ = _saved_loop(tmp_path)
    crafted = tmp_path / "crafted.pt"
    crafted.write_bytes(b"\x80\x02cevil\x1b]0;PWNED-TITLE\x07\nname\n.")
    crafted.chmod(0o600)
    client = RunClient(loop.run.agent.info)
    errors: list[BaseException] = []

    def steer() -> None:
        try:
            client.set("rewind", str(crafted), timeout_s=60)  # (at the earliest step:
            # a step named here could pass while the command is on its way)
        except BaseException as exc:  # noqa: BLE001 -- looked at below
            errors.append(exc)

    import threading

    thread = threading.Thread(target=steer)
    thread.start()
    while thread.is_alive():  # the test is the training thread
        loop.train(1)
        thread.join(0.01)
    client.close()
    loop.records()
    [error] = errors
    assert isinstance(error, CommandError), error
    assert "\x1b" not in str(error) and "\x07" not in str(error)
    assert "␛]0;PWNED-TITLE␇" in str(error), str(error)
    assert "\x1b]0;PWNED-TITLE\x07" in error.body["text"]  # the event as the run sent it

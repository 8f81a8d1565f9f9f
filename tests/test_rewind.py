"""``rewind=<step or path>``: its value kind, its refusals (at once, with the reason,
changing nothing), branch ids over several rewinds, the ``branched`` event's place in
the run log, and the rollback of the state as a branch. The exactness of a rewind in
every integration is the contract's (``tests/test_contract.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import agent
from agent.wire.commands import RankConnections
from agent.wire.knobs import REWIND, TEXT_MAX_CHARS, KnobError
from gpuopt.loader import ReconfigurableLoader
from gpuwatch.client import RunClient, send_command
from gpuwatch.history import flat_records
from tests.conftest import wait_until
from tests.contract import IndexedDigits, Net, loss_fn, optimizer_and_schedule
from tests.jobs import finish, run_job, torchrun

#: How long a script's wait for a moved command lasts before it ends (s): a generous
#: bound for one step and an event to arrive; the test takes that long.
WAIT_S = 8


def test_the_text_kind_takes_bounded_text_without_control_characters():
    assert REWIND.coerce(" 120 ") == "120"
    assert REWIND.coerce(120) == "120"
    assert REWIND.coerce("/ckpt/step 1.pt") == "/ckpt/step 1.pt"
    assert REWIND.coerce("é" * TEXT_MAX_CHARS) == "é" * TEXT_MAX_CHARS
    for bad, words in ((True, "not text"), (1.5, "not text"), (None, "not text"),
                       ("", "empty"), ("   ", "empty"),
                       ("x" * (TEXT_MAX_CHARS + 1), "4,097 characters, more than the 4,096"),
                       ("/ckpt\x1b[2J", "U+001B"), ("/a\nb", "U+000A"),
                       ("/a\x85b", "U+0085"), ("/a\x7f", "U+007F")):
        with pytest.raises(KnobError, match="^rewind: ") as error:
            REWIND.coerce(bad)
        assert words in str(error.value), (bad, error.value)
        assert len(str(error.value)) <= 200  # the bad value is quoted, shortened
    assert REWIND.to_wire()["kind"] == "text" and REWIND.to_wire()["max_chars"] == 4096
    assert REWIND.command and not REWIND.keys  # no key: too dangerous for a stray one


class Loop:
    """A hand-written loop under :func:`agent.session` on the contract's task, trained
    here step by step (the test is its training thread), with the losses of each step
    as the run log has them."""

    def __init__(self, checkpoint_dir: Path) -> None:
        self.model = Net()
        self.optimizer, self.scheduler = optimizer_and_schedule(self.model)
        self.run = agent.session(model=self.model, optimizer=self.optimizer,
                                 lr_scheduler=self.scheduler, precision="fp32",
                                 accum_steps=2, checkpoint_dir=checkpoint_dir)
        self.batches = iter(self.run.loader(ReconfigurableLoader(
            IndexedDigits(), 8, shuffle=True, seed=3), epochs=None))

    def train(self, steps: int) -> None:
        """Train ``steps`` optimizer steps."""
        for _ in range(steps):
            for _ in range(self.run.accum_steps):
                x, y, _ = next(self.batches)
                with self.run.autocast:
                    loss = loss_fn(self.model(x), y) / self.run.accum_steps
                self.run.scaler.scale(loss).backward()
            self.run.scaler.step(self.optimizer)
            self.run.scaler.update()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.run.optimizer_step()

    def send(self, knob: str, value: Any) -> dict[str, Any]:
        """Send ``knob=value`` through the run's socket, to apply at the boundary after
        the next step (the test is between two steps)."""
        return dict(send_command(self.run.agent.info, knob, value,
                                 apply_step=self.run.step + 2, timeout_s=10))

    def records(self) -> list[dict[str, Any]]:
        """The run log, once the run is closed."""
        path = self.run.agent.info.log_path
        self.run.close()
        return list(flat_records(path))


def _twin_and_saved(tmp_path: Path) -> tuple[list[float], Loop]:
    """The losses of a twin's 6 steps (a checkpoint after step 3, no other command), and
    a loop at step 2 with the same checkpoint asked for (saved after its step 3)."""
    twin = Loop(tmp_path / "twin")
    twin.train(2)
    assert twin.send("checkpoint", "now")["ok"]  # saved after step 3
    twin.train(4)
    want = [r["loss"] for r in twin.records() if r["type"] == "step"]
    loop = Loop(tmp_path)
    loop.train(2)
    assert loop.send("checkpoint", "now")["ok"]
    return want, loop


def test_a_bad_rewind_is_refused_at_once_with_the_reason_and_changes_nothing(run_dir,
                                                                             tmp_path):
    want, loop = _twin_and_saved(tmp_path)  # (the twin: without the commands refused)
    loop.train(2)
    saved = tmp_path / "step-00000003.pt"
    assert saved.is_file()
    (tmp_path / "link.pt").symlink_to(saved)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    refused = {
        "7": "the checkpoint command saved no step 7 (no "
             f"{tmp_path / 'step-00000007.pt'}); saved: step 3",
        "step-00000003.pt": "neither a step nor an absolute path",
        str(tmp_path / "none.pt"): "no checkpoint at",
        str(tmp_path / "link.pt"): "is a symlink, which is not followed",
        "/a\x1b[2J": "control character",
        "x" * (TEXT_MAX_CHARS + 1): "more than the 4,096",
    }
    if os.geteuid() != 0:  # (root reads any file)
        unreadable = tmp_path / "unreadable.pt"
        unreadable.write_bytes(saved.read_bytes())
        unreadable.chmod(0)
        refused[str(unreadable)] = "is not readable by the training process"
    for value, words in refused.items():
        reply = loop.send("rewind", value)
        assert not reply["ok"] and words in reply["reason"], (value, reply)
    # gpuwatch set passes the text through, and prints the run's reason
    cli = subprocess.run([sys.executable, "-m", "gpuwatch", "set",
                          f"rewind={tmp_path / 'none.pt'}"], capture_output=True, text=True,
                         timeout=60)
    assert cli.returncode == 1 and cli.stderr.startswith("rejected: "), cli.stderr
    assert f"no checkpoint at {tmp_path / 'none.pt'}" in cli.stderr, cli.stderr
    # readable, but no checkpoint: it fails where it applies (after step 5), and the
    # training goes on as if it had never been sent
    assert loop.send("rewind", str(tmp_path / "junk.pt"))["ok"]
    loop.train(2)
    assert loop.run.step == 6 and loop.run.branch == 0
    records = loop.records()
    events = [r for r in records if r["type"] == "event"]
    [failed] = [e for e in events if e.get("kind") == "failed"]
    assert failed["knob"] == "rewind" and failed["step"] == 6, failed
    assert "not a checkpoint" in failed["text"] or "junk.pt" in failed["text"], failed
    assert not [e for e in events if e.get("kind") == "branched"]
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, 7))
    assert [r["loss"] for r in records if r["type"] == "step"] == want


def test_rewinds_make_a_tree_of_branches_each_announced_before_its_steps(run_dir,
                                                                          tmp_path):
    """A checkpoint after step 3; rewind=3 after step 6 (branch 1 of 0 at step 3); a
    checkpoint after step 5 of branch 1; a rewind by that checkpoint's path after its
    step 7 (branch 2 of 1 at step 5). Each branch's steps equal its parent's from the
    fork (the same state, data position and random numbers), bit for bit."""
    loop = Loop(tmp_path)
    loop.train(2)
    assert loop.send("checkpoint", "now")["ok"]
    loop.train(3)
    assert loop.send("rewind", "3")["ok"]
    loop.train(1)
    assert loop.run.branch == 1 and loop.run.step == 3
    # the agent counts from the fork at once: a command's earliest step is the new
    # branch's next one, not the left branch's
    assert loop.run.agent.last_step == 3
    loop.train(1)
    assert loop.send("checkpoint", "now")["ok"]
    loop.train(2)
    second = tmp_path / "step-00000005.pt"
    assert loop.send("rewind", str(second))["ok"]
    loop.train(1)
    assert loop.run.branch == 2 and loop.run.step == 5
    loop.train(2)
    records = loop.records()
    branched = [r for r in records if r["type"] == "event" and r.get("kind") == "branched"]
    assert [(r["branch"], r["parent"], r["step"], r["source"], r["cause"])
            for r in branched] == [
        (1, 0, 3, str(tmp_path / "step-00000003.pt"), "rewind=3"),
        (2, 1, 5, str(second), f"rewind={second}")]
    assert " with " in branched[0]["text"] and "accum_steps=2" in branched[0]["text"]
    # readers give each step record the branch of the last branched event before it
    branch, segments = 0, {0: [], 1: [], 2: []}
    losses: dict[tuple[int, int], float] = {}
    for record in records:
        if record["type"] == "event" and record.get("kind") == "branched":
            branch = record["branch"]
        elif record["type"] == "step":
            segments[branch].append(record["step"])
            losses[(branch, record["step"])] = record["loss"]
    assert segments == {0: [1, 2, 3, 4, 5, 6], 1: [4, 5, 6, 7], 2: [6, 7]}
    for step in (4, 5, 6):
        assert losses[(1, step)] == losses[(0, step)], step
    for step in (6, 7):
        assert losses[(2, step)] == losses[(1, step)], step


def test_a_pending_command_keeps_its_distance_from_the_rewind(run_dir, tmp_path):
    """``lr_scale=0.5`` accepted for step 9 while the run is at step 5; ``rewind=3``
    applies at the boundary before step 7: due 9 - 7 = 2 steps after that boundary, it
    applies 2 steps after the fork's (before step 4), at 4 + 2 = 6 = 9 - (6 - 3), with a
    ``rescheduled`` event. The branch's steps 4-8 equal, bit for bit, those of a twin
    that sets lr_scale=0.5 for step 6 with no rewind. A command counted on branch 0 that
    arrives after the rewind (a fan-out's second phase) is moved the same way, or
    refused where its step was at or before the rewind's."""
    twin = Loop(tmp_path / "twin")
    twin.train(2)
    assert twin.send("checkpoint", "now")["ok"]
    twin.train(1)
    assert dict(send_command(twin.run.agent.info, "lr_scale", 0.5, apply_step=6,
                             timeout_s=10))["ok"]
    twin.train(5)
    want = {r["step"]: r["loss"] for r in twin.records() if r["type"] == "step"}
    loop = Loop(tmp_path)
    loop.train(2)
    assert loop.send("checkpoint", "now")["ok"]  # saved after step 3
    loop.train(3)
    assert loop.send("rewind", "3")["apply_step"] == 7
    reply = dict(send_command(loop.run.agent.info, "lr_scale", 0.5, apply_step=9,
                              timeout_s=10))
    assert reply["ok"] and reply["apply_step"] == 9 and reply["step"] == 5, reply
    loop.train(1)
    assert loop.run.branch == 1 and loop.run.step == 3
    info = loop.run.agent.info
    with RankConnections([info]) as connection:  # counted on branch 0, come late (the
        late = [connection.exchange({"id": f"late-{apply_step}", "knob": "accum_steps",
                                     "value": 2, "apply_step": apply_step,  # value it has)
                                     "branch": branch},
                                    10, None)[0]
                for apply_step, branch in ((10, 0), (7, 0), (10, 2))]
    assert late[0]["ok"] and late[0]["apply_step"] == 10 - 3 and late[0]["branch"] == 1
    assert late[1]["reason"] == ("apply_step 7 of branch 0 has passed on rank 0: the run "
                                 "went back to step 3 at step 7 (branch 1)"), late[1]
    assert late[2]["reason"] == ("branch 2 is not one rank 0 can count from (it trains "
                                 "branch 1)"), late[2]
    loop.train(5)
    records = loop.records()
    events = [r for r in records if r["type"] == "event"]
    [moved] = [e for e in events if e.get("kind") == "rescheduled"]
    assert (moved["knob"], moved["value"], moved["step"], moved["previous_step"],
            moved["branch"]) == ("lr_scale", 0.5, 6, 9, 1), moved
    assert moved["text"] == ("lr_scale=0.5 now applies at step 6, not 9: the run went "
                             "back to step 3 at step 7 (branch 1) and it stays 2 steps "
                             "after that boundary"), moved
    kinds = [e.get("kind") for e in events]
    assert kinds.index("rescheduled") == kinds.index("branched") + 1
    applied = {(e["knob"], e["step"]) for e in events if e.get("kind") == "applied"}
    assert {("lr_scale", 6), ("accum_steps", 7)} <= applied, applied
    branch, steps = 0, []
    for record in records:
        if record["type"] == "event" and record.get("kind") == "branched":
            branch = record["branch"]
        elif record["type"] == "step" and branch == 1:
            steps.append(record["step"])
            assert record["knobs"]["lr_scale"] == (0.5 if record["step"] >= 6 else 1.0)
            assert record["loss"] == want[record["step"]], record["step"]
    assert steps == [4, 5, 6, 7, 8]


def test_a_command_at_the_rewinds_own_boundary_applies_at_the_forks_step(run_dir, tmp_path):
    """``rewind=3`` and ``lr_scale=0.5`` both for the boundary before step 7: the rewind
    applies first (it is not a setting), and the setting after it, on branch 1, at the
    fork's boundary: its event says step 4, and step 4 of branch 1 trains with it."""
    loop = Loop(tmp_path)
    loop.train(2)
    assert loop.send("checkpoint", "now")["ok"]  # saved after step 3
    loop.train(3)
    assert loop.send("rewind", "3")["apply_step"] == 7
    assert loop.send("lr_scale", 0.5)["apply_step"] == 7
    loop.train(2)
    assert loop.run.branch == 1 and loop.run.step == 4
    records = loop.records()
    [applied] = [r for r in records if r["type"] == "event" and r.get("knob") == "lr_scale"
                 and r.get("kind") == "applied"]
    assert applied["step"] == 4 and applied["text"].startswith(
        "lr_scale=0.5 applied at step 4"), applied
    assert not [r for r in records if r.get("kind") == "rescheduled"]
    assert [(r["step"], r["knobs"]["lr_scale"]) for r in records
            if r["type"] == "step"][-2:] == [(6, 1.0), (4, 0.5)]


def test_a_scripts_wait_follows_its_command_moved_by_a_rewind(run_dir, tmp_path):
    """``RunClient.set`` waits for its own command by id: one that a rewind moved is
    followed to its new step; when the wait ends first, its error says where it went."""
    loop = Loop(tmp_path)
    loop.train(2)
    assert loop.send("checkpoint", "now")["ok"]  # saved after step 3
    loop.train(3)
    assert loop.send("rewind", "3")["apply_step"] == 7
    client = RunClient(loop.run.agent.info)
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            client.set("lr_scale", 0.5, apply_step=9, timeout_s=WAIT_S)
        except TimeoutError as exc:
            outcome["error"] = str(exc)

    waiting = threading.Thread(target=wait)
    waiting.start()
    wait_until(lambda: any(p.knob == "lr_scale" for p in list(loop.run.agent._desk.pending)),
               "the command accepted")
    loop.train(1)  # rewind=3 applies: the command moves from step 9 to 6; no step 6 comes
    waiting.join(WAIT_S + 60)
    client.close()
    assert outcome["error"] == (f"lr_scale=0.5 not applied within {WAIT_S:g} s (accepted "
                                "for step 9, moved to step 6 of branch 1)"), outcome
    loop.records()


@pytest.mark.slow
def test_a_rewind_applies_on_every_rank_at_one_step_or_on_none(run_dir, tmp_path):
    """DDP on gloo, 2 ranks (torchrun), a hand-written loop: ``rewind=3`` after step 7
    puts both ranks back to the checkpoint of step 3 at the same boundary (branch 1 of
    0 on each), and steps 4-10 equal, on each rank, those of a job resumed from that
    checkpoint (bit-equal losses and final parameters); ``accum_steps=2`` accepted on
    both for step 10 keeps its 2 steps from the rewind's boundary on both: it applies
    at 10 - (7 - 3) = 6. When rank 1 cannot read it, no rank rewinds: both say why
    (rank 0 with rank 1's reason), at the same step, and train on from where they were
    (the command applies at 10)."""
    job = str(Path(__file__).with_name("ddp_rewind_job.py"))
    run_job(job, str(tmp_path), "rewind")
    refused = tmp_path / "refused"
    refused.mkdir()
    finish(torchrun(job, str(tmp_path), "resume"), torchrun(job, str(refused), "refused"))
    for rank in (0, 1):
        rewound = torch.load(tmp_path / f"rewind-rank{rank}.pt")
        resumed = torch.load(tmp_path / f"resume-rank{rank}.pt")
        branched, moved, applied = rewound["events"]
        assert (branched["kind"], branched["branch"], branched["parent"],
                branched["step"]) == ("branched", 1, 0, 3), branched
        assert (moved["kind"], moved["step"], moved["previous_step"], moved["branch"]) == (
            "rescheduled", 6, 10, 1), moved
        assert "stays 2 steps after that boundary" in moved["text"], moved
        assert (applied["kind"], applied["step"]) == ("applied", 6), applied
        assert rewound["order"] == [1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10], rank
        assert sorted(resumed["losses"]) == list(range(4, 11))
        for step in range(4, 11):
            assert rewound["losses"][step] == resumed["losses"][step], (rank, step)
        for mine, theirs in zip(rewound["params"], resumed["params"], strict=True):
            assert torch.equal(mine, theirs)
        failed = torch.load(refused / f"refused-rank{rank}.pt")
        event, applied = failed["events"]
        assert event["kind"] == "failed" and event["step"] == 8, event
        assert (applied["kind"], applied["step"]) == ("applied", 10), applied
        words = ("injected: rank 1 cannot read" if rank == 1  # (its own error)
                 else "rank 1: OSError: injected: rank 1 cannot read")
        assert words in event["text"], event
        assert rank == 1 or "no rank rewinds" in event["text"], event
        assert failed["order"] == list(range(1, 11)), rank


def test_a_checkpoints_knob_values_are_validated_and_its_commands_never_run(run_dir,
                                                                            tmp_path):
    """A checkpoint file is untrusted: ``stop=now`` in its knobs does not stop the run
    (a command is never run from a file), a bad value is refused with the reason in the
    ``branched`` event, and the other values still apply."""
    loop = Loop(tmp_path)
    loop.train(2)
    assert loop.send("checkpoint", "now")["ok"]
    loop.train(2)
    saved = torch.load(tmp_path / "step-00000003.pt", weights_only=True)
    saved["knobs"] = {**saved["knobs"], "stop": "now", "pause": "on",
                      "precision": "fp99", "lr_scale": "much", "accum_steps": 4}
    crafted = tmp_path / "crafted.pt"
    torch.save(saved, crafted)
    assert loop.send("rewind", str(crafted))["ok"]
    loop.train(3)
    assert loop.run.stop_requested is None and not loop.run.stopping
    assert loop.run.step == 5 and loop.run.branch == 1 and loop.run.accum_steps == 4
    assert loop.run.knobs.knobs["precision"].get() == "fp32"
    [branched] = [e for e in loop.records() if e.get("kind") == "branched"]
    assert branched["level"] == "warning", branched
    for said in ("accum_steps=4", "not restored: ", "stop=now (a command, never run from "
                 "a checkpoint)", "pause=on (a command", "precision=fp99 (", "lr_scale=much ("):
        assert said in branched["text"], (said, branched["text"])


def test_a_checkpoint_directorys_files_are_read_bounded_never_through_a_link(tmp_path):
    from agent.control.checkpoints import (KNOBS_FILE, MAX_KNOBS_FILE_BYTES, load_tensors,
                                           read_knobs_file)
    assert read_knobs_file(tmp_path) == {}  # the framework saved it on its own
    (tmp_path / KNOBS_FILE).write_text('{"step": 3, "knobs": {"accum_steps": 2}}')
    assert read_knobs_file(tmp_path) == {"step": 3, "knobs": {"accum_steps": 2}}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.json").write_text('{"knobs": {}}')
    torch.save({"rng": torch.zeros(2)}, elsewhere / "rng.pt")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / KNOBS_FILE).symlink_to(elsewhere / "secret.json")
    (linked / "rng.pt").symlink_to(elsewhere / "rng.pt")
    with pytest.raises(OSError):
        read_knobs_file(linked)
    with pytest.raises(OSError):
        load_tensors(linked / "rng.pt")
    assert torch.equal(load_tensors(elsewhere / "rng.pt")["rng"], torch.zeros(2))
    (elsewhere / KNOBS_FILE).write_text(" " * MAX_KNOBS_FILE_BYTES + "{}")
    with pytest.raises(ValueError, match="larger than the 1.0 MiB"):
        read_knobs_file(elsewhere)
    (elsewhere / KNOBS_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match="does not hold gpuwatch's knob values"):
        read_knobs_file(elsewhere)


def test_a_missing_step_names_the_saved_steps_nearest_it(tmp_path):
    """rewind=N for a step with no checkpoint says which steps have one (the dashboard
    says a checkpoint applied at step 708 "saved after step 707"), in each naming."""
    from agent.control.checkpoints import Checkpoints
    from agent.integrations.run import _saved_steps_text

    assert _saved_steps_text([], 5) == "; none saved yet (checkpoint=now saves one)"
    assert _saved_steps_text([707], 708) == "; saved: step 707"
    assert _saved_steps_text(list(range(10, 200, 10)), 100) == (
        "; saved: steps 70, 80, 90, 100, 110, 120 (13 more)")
    for name, files in (("step-{step:08d}.pt", ["step-00000707.pt", "step-00000806.pt"]),
                        ("checkpoint-{step}", ["checkpoint-707", "checkpoint-806"])):
        directory = tmp_path / name.split("-")[0]
        directory.mkdir()
        for file in files + ["notes.txt", "step-x.pt", "checkpoint-"]:
            (directory / file).write_bytes(b"")
        saver = Checkpoints(None, lambda path, knobs: None,  # type: ignore[arg-type]
                            step=lambda: 0, directory=directory, name=name)
        assert saver.saved_steps() == [707, 806], name
    assert Checkpoints(None, lambda path, knobs: None,  # type: ignore[arg-type]
                       step=lambda: 0, directory=tmp_path / "none").saved_steps() == []


@pytest.mark.parametrize("copy", ["kept", "too large"])
def test_a_checkpoint_that_loads_part_way_changes_nothing_or_stops_the_run(
        copy, run_dir, tmp_path, monkeypatch):
    """A checkpoint of another model (its last layer one class wider): torch loads the
    layers that match, then raises. Before, the training went on from that mix of two
    models. Now the state as it was comes back (a host copy taken first) and the run
    trains on bit for bit as its twin without the command; where no copy can be taken
    (over its budget), the run stops at that boundary with an error event instead."""
    want, loop = _twin_and_saved(tmp_path)
    loop.train(1)
    other = tmp_path / "other-model.pt"
    state = torch.load(tmp_path / "step-00000003.pt", weights_only=True)
    model_state = next(value for value in state.values() if isinstance(value, dict)
                       and any(key.endswith("weight") for key in value))
    last = [key for key in model_state if key.endswith("weight")][-1]
    model_state[last] = torch.cat([model_state[last], model_state[last][:1]])
    torch.save(state, other)
    if copy == "too large":
        monkeypatch.setattr("agent.integrations.run.ROLLBACK_BUDGET_BYTES", 16)
    assert loop.send("rewind", str(other))["ok"]  # applies after step 4
    loop.train(3 if copy == "kept" else 1)
    records = loop.records()
    events = [r for r in records if r["type"] == "event"]
    [failed] = [e for e in events if e.get("kind") == "failed"]
    assert failed["knob"] == "rewind" and "size mismatch" in failed["text"], failed
    assert not [e for e in events if e.get("kind") == "branched"]
    losses = [r["loss"] for r in records if r["type"] == "step"]
    if copy == "kept":
        assert loop.run.step == 6 and losses == want  # as if never sent
        return
    assert losses == want[:4] and loop.run.stop_requested == "now"
    [stopped] = [e for e in events if "could not be put back either" in e["text"]]
    assert stopped["level"] == "error" and "the training stops after step 4" in (
        stopped["text"]) and "larger than the 16 B" in stopped["text"], stopped

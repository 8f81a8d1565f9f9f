"""A DDP job (gloo, CPU) for the test of a loss-spike recovery on every rank:
``torchrun --nproc-per-node 2 tests/ddp_recovery_job.py OUT MODE``.

Each rank trains the contract's task (:mod:`tests.contract`: its Net, AdamW and
LambdaLR, windows of 2 micro-batches) with
``recover=Recovery(keep_every_steps=10, keep_states=150)`` (the fan-out's margin is
tens of these millisecond steps) over a DistributedSampler's shard: in a hand-written
loop, the model in DistributedDataParallel (``loop``: :class:`tests.jobs.ContractLoop`),
or in Fabric's loop under ``strategy="ddp"`` (``fabric``:
:class:`tests.jobs.ContractFabricLoop`); rank 0 sends ``recover=on`` to every rank
for step 3. Micro-batches 41-46 of each rank (steps 21-23) have poisoned labels
(:class:`tests.contract.Poison`); rank 0 waits at step 23 until its spike watch found
the spike and the recovery was scheduled on it for the step every rank agreed on (the
other rank waits for it in DDP's all-reduce), and the job trains on
until it was done and step 40 is reached. ``MODE``: ``loop`` or ``fabric``; or, in
the loop, one that makes rank 1's copy of its state fail at one step: ``copy-20`` at
step 20 (rank 0 holds step 20's state, rank 1 only step 10's), ``copy-2`` at step 2,
where ``recover=on`` applies (the job then trains to step 40 with recover off); or
``position``: rank 1's data position cannot be read once the spike began (its
``state_dict`` raises after step 20), so the recovery, which reads it, cannot go on
there (the job trains to step 40 after the warning that says so). Each
rank saves ``OUT/<MODE>-rank<N>.pt``: its ``branched`` events, the step each came after,
its warnings and failed events, its ``recover`` value at the end, and the final
parameters."""

import sys
import threading
from pathlib import Path

from agent.control.recovery import Recovery
from agent.wire.commands import send_command
from tests.contract import POISON
from tests.jobs import ContractFabricLoop, ContractLoop

STEPS = 40


def main(out: Path, mode: str) -> None:
    policy = Recovery(keep_every_steps=10, keep_states=150)  # (1,500 steps: on a
    # busy host the fan-out picked a step past 320 for Fabric's millisecond steps)
    loop = (ContractFabricLoop("fabric-ddp-recovery", recover=policy) if mode == "fabric"
            else ContractLoop("ddp-recovery", recover=policy))
    run, rank = loop.run, loop.rank
    recovered = threading.Event()
    if mode == "copy-2":
        recovered.set()  # (recover=on fails: there is no recovery to wait for)
    events: list[dict] = []
    problems: list[dict] = []
    last_step = [0]

    def listener(record: dict) -> None:
        if record["type"] == "step":
            last_step[0] = record["step"]
            if rank == 0 and record["step"] == 1:
                reply = send_command(run.agent.info, "recover", "on", apply_step=3,
                                     timeout_s=30)
                assert reply["ok"], reply
            if rank == 0 and record["step"] == 23 and not recovered.is_set():
                # the watch decides on the I/O thread, and the fan-out to every rank
                # takes its two phases: the test waits for both (on a busy host the
                # training would otherwise run on far past the spike first)
                for _ in range(6000):
                    if any(pending.knob == "recover"
                           for pending in list(run.agent._desk.pending)):
                        break
                    threading.Event().wait(0.01)
        elif record.get("kind") == "branched":
            events.append({key: record[key] for key in (
                "branch", "parent", "step", "source", "text")} | {"after": last_step[0]})
            recovered.set()
        elif record["type"] == "event" and record.get("kind") in ("warning", "failed"):
            problems.append({key: record.get(key) for key in ("kind", "knob", "text")})
            if "not recovered" in record["text"]:
                recovered.set()  # (the recovery's answer: none)

    if mode.startswith("copy-") and rank == 1:
        failing_step, snapshot = int(mode.removeprefix("copy-")), run.state_snapshot

        def state_snapshot(*args, **kwargs):
            if run.step == failing_step:
                raise MemoryError("injected: host memory short on rank 1")
            return snapshot(*args, **kwargs)

        run.state_snapshot = state_snapshot
    if mode == "position" and rank == 1:
        read = run.position.state_dict

        def position_state() -> dict:
            if run.step > 20:
                raise OSError("injected: rank 1's data position cannot be read")
            return read()

        run.position.state_dict = position_state
    run.agent.add_listener(listener)
    POISON.micro_batches, POISON.trained = range(41, 47), 0
    while not (run.step >= STEPS and recovered.is_set()):
        loop.train_window()
        if run.step > 1600:
            break
    loop.close({"events": events, "problems": problems,
                "recover": run.knobs.knobs["recover"].get(), "params": loop.params()},
               out / f"{mode}-rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])

"""The one-line run header: status, step, records missed (when any), name, device, run id.

With several ranks, also the rank shown and the slowest rank when it lags."""

from __future__ import annotations

from textual.content import Content

from gpuwatch.state import RunState
from gpuwatch.units import human_age, human_number
from gpuwatch.widgets.panel import Panel

#: A rank this much slower (smoothed step time) than the fastest is named in the header.
STRAGGLER_SHARE = 0.05
#: A multi-node job's node whose ranks spend this share of their steps waiting for data
#: (or more, the most of all nodes) is named in the header (as "partly input-bound").
NODE_DATA_WAIT_SHARE = 0.2
#: Theme variable that colours each run status.
STATUS_STYLES = {"waiting": "$text-muted", "live": "bold $success",
                 "compiling": "bold $warning", "stalled": "bold $warning",
                 "paused": "bold $warning", "evaluating": "bold $warning",
                 "saving": "bold $warning",
                 "quiet": "bold $warning", "gone": "bold $error", "ended": "$text-muted"}


class RunHeader(Panel):
    """Who the dashboard watches and whether the run is alive, then what was missed on the way.

    ``compiling…`` with the seconds so far while the run compiles; then records missed or
    malformed on the way and the agent's own dropped records, errors and rejected commands
    when there are any."""

    def show(self, state: RunState, status: str, now: float, *, description: str,
             readonly: bool, replay: bool = False) -> None:
        """Redraw from ``state`` (read under the source's lock).

        Args:
            status: the state's status, computed once by the caller.
            now: monotonic time in s (how long a compile has taken).
            description: what the source watches, shown while waiting.
            readonly: whether keys send commands.
            replay: a finished run on a timeline: the steps a run made while it was live
                are labelled ``● replay``, not ``● live``.
        """
        width = self.app.size.width
        for narrow, graph, name, counts in ((False, True, True, True),
                                            (True, True, True, True),
                                            (True, False, True, True),
                                            (True, False, False, True),
                                            (True, False, False, False)):
            # what gives way first: the dashboard's name, then the compiled graph, then
            # the run's name and device, then the counts of records missed or dropped
            # and of commands rejected: the run id stays whole
            content = self._content(state, status, now, description=description,
                                    readonly=readonly, narrow=narrow, graph=graph,
                                    name=name, replay=replay, counts=counts)
            if not len(content.plain) + 2 > width > 0:
                break
        self.set_content(content)

    def _content(self, state: RunState, status: str, now: float, *, description: str,
                 readonly: bool, narrow: bool, graph: bool = True, name: bool = True,
                 replay: bool = False, counts: bool = True) -> Content:
        """The header's text; ``narrow``: without the dashboard's name, the device
        after the run id; ``graph``: with the graph a compile is at; ``name``: with the
        run's name and device; ``replay``: see :meth:`show`; ``counts``: with the counts
        of records missed or dropped and of commands rejected (the agent's errors
        are always said)."""
        parts: list[str | tuple[str, str]] = [] if narrow else [
            ("gpuwatch", "bold $primary"), "  "]
        if status == "waiting":
            parts.append((f"waiting for {description} ...", STATUS_STYLES[status]))
        else:
            label = "replay" if replay and status == "live" else status
            if status == "compiling" and state.compiling_since is not None:
                label = compile_label(state, now, graph=graph)
            parts += [(f"● {label}", "bold $text-muted" if label == "replay"
                       else STATUS_STYLES[status]), "  "]
            if readonly:
                parts += [("read-only", "$warning"), "  "]
            parts.append((f"step {human_number(state.shown_step)}", "bold"))
            if (state.missed or state.malformed) and counts:  # said only when there are some
                parts += ["  ", (f"missed {state.missed}" + (
                    f" malformed {state.malformed}" if state.malformed else ""), "$warning")]
            if state.agent_records_dropped and counts:
                parts += ["  ", (f"dropped {state.agent_records_dropped}", "$warning")]
            if state.agent_errors:
                parts += ["  ", (f"agent errors {state.agent_errors}", "$error")]
            if state.agent_commands_rejected and counts:
                parts += ["  ", (f"rejected {state.agent_commands_rejected}", "$warning")]
            # what a person reads before the run id; narrow: the device after it
            for key in ("name",) if narrow else ("name", "device"):
                if state.hello.get(key) and name:
                    parts += ["  ", (str(state.hello[key]), "bold" if key == "name" else "")]
            parts.append(f"  run {state.run_id}")
            if narrow and name and state.hello.get("device"):
                parts.append(f"  {state.hello['device']}")
            world_size = state.hello.get("world_size")
            if type(world_size) is int and world_size > 1:  # the charts are one rank's
                parts.append(f" (rank {state.primary_rank} of {world_size}")
                slowest = state.slowest_rank(now)
                if slowest is not None and slowest[1] >= STRAGGLER_SHARE:
                    node = state.node_of(slowest[0])
                    where = f" (node {node})" if node is not None else ""
                    parts += [", ", (f"rank {slowest[0]}{where} slowest +{slowest[1]:.0%}",
                                     "$warning")]
                waiting = state.most_waiting_node(now)
                if waiting is not None and waiting[1] >= NODE_DATA_WAIT_SHARE:
                    parts += [", ", (f"node {waiting[0]} data wait {waiting[1]:.0%}",
                                     "$warning")]
                silent = state.silent_nodes(now)
                if silent:  # commands are refused until they answer again
                    parts += [", ", ("node" + ("s " if len(silent) > 1 else " ")
                                     + ", ".join(map(str, silent)) + " silent", "$error")]
                parts.append(")")
                differ = state.knobs_differ()
                if differ is not None:  # said first: it must not be cut off
                    rank, step, knob, shown, other = differ
                    at = 0 if narrow else 2  # after the name, when it is shown
                    parts[at:at] = [(f"KNOBS DIFFER at step {step}: {knob} "
                                   f"{shown} (rank {state.primary_rank}) vs {other} "
                                   f"(rank {rank})", "bold $error"), "  "]
        if readonly and status == "waiting":
            parts += ["  ", ("read-only", "$warning")]
        return Content.assemble(*parts)


def compile_label(state: RunState, now: float, *, graph: bool = True) -> str:
    """What the header says while the run compiles: the time so far, against its last compile.

    The time so far, against the run's own last compile (``of ~1m24s``, or
    ``last took 1m24s`` once this one is longer), and which graph
    (``graph 3 [0/1 backward]``: the third of this compile, Dynamo's compile id and which
    pass; with ``graph``). Needs ``state.compiling_since``."""
    assert state.compiling_since is not None
    elapsed = now - state.compiling_since
    label = f"compiling… {human_age(elapsed)}"
    if state.compile_durations_s:  # the run's own earlier compile: the estimate
        last = state.compile_durations_s[-1]
        label += f" of ~{human_age(last)}" if elapsed < last else \
            f" (last took {human_age(last)})"
    at = state.compile_graph
    if at is not None and graph:
        label += f", graph {at['number']} [{at['graph']} {at['kind']}]".replace(" ]", "]")
    return label

"""A run's branches as people read them: the tree of segments, and ``RUN@bN`` that names one.

The tree of segments that ``gpuwatch runs``, its screen, ``compare`` and ``report`` show,
and the ``RUN@bN`` syntax that names one branch.

A run starts on branch 0; each time its training state is put back (``rewind=``, a
rollback that restores the state, spike recovery) it goes on as a new branch (the
``branched`` event, :class:`agent.wire.runlog.BranchTree`)::

    b0 steps 1-200
    └ b1 from step 120 (rewind=120) steps 121-300: lr_scale=0.5   (latest)

Every text from a log goes through :func:`agent.wire.protocol.printable` and is cut.
"""

from __future__ import annotations

import re

from agent.wire.protocol import printable
from agent.wire.runlog import Branch, BranchTree
from gpuwatch.units import knob_text

#: ``RUN@bN``: a run (id, prefix or log path) and one of its branches.
BRANCH_SELECTOR = re.compile(r"(?P<run>.+)@b(?P<branch>[0-9]{1,7})")
#: Lines of a tree shown at most (the others are counted on a last line).
MAX_TREE_LINES = 40
#: Indentation levels drawn at most (deeper branches are drawn at this depth).
MAX_DEPTH = 12
#: Characters of a branch's cause shown (a longer one loses its middle).
MAX_CAUSE_CHARS = 40


def split_selector(selector: str) -> tuple[str, int | None]:
    """``RUN@bN`` as ``(RUN, N)``; anything else as ``(selector, None)``."""
    found = BRANCH_SELECTOR.fullmatch(selector)
    if found is None:
        return selector, None
    return found["run"], int(found["branch"])


def _steps(branch: Branch) -> str:
    if branch.first_step is None or branch.last_step is None:
        return "no steps yet"
    return f"steps {branch.first_step:,}-{branch.last_step:,}"


def changes_text(branch: Branch) -> str:
    """The knob changes made on ``branch``: ``lr_scale=0.5, accum_steps=2``; "" without one.

    And how many more were made than it keeps."""
    shown = [f"{printable(knob, 40)}={printable(knob_text(value), 40)}"
             for _, knob, value in branch.applied]
    more = branch.changes - len(shown)
    return ", ".join(shown + ([f"{more:,} more"] if more > 0 else []))


def branch_title(branch: Branch) -> str:
    """A branch in a few words: ``b1 from step 120 (rewind=120)`` (``b0`` for the start)."""
    text = f"b{branch.branch}"
    if branch.parent is not None:
        fork = "?" if branch.fork_step is None else f"{branch.fork_step:,}"
        text += f" from step {fork}"
        why = _short(printable(branch.cause or branch.source))
        text += f" ({why})" if why else ""
    return text


def _short(why: str) -> str:
    """A branch's cause in :data:`MAX_CAUSE_CHARS`: a checkpoint's path loses its middle
    (its end says the most), prose its end, at a word (``loss spike: loss 1.99 at…``)."""
    if len(why) <= MAX_CAUSE_CHARS:
        return why
    if "/" in why.split(" ", 1)[0]:  # rewind=/a/path (a path may have spaces later)
        return why[:MAX_CAUSE_CHARS // 3] + "…" + why[-(MAX_CAUSE_CHARS * 2 // 3 - 1):]
    cut = why[:MAX_CAUSE_CHARS - 1]
    if why[len(cut)] not in " ,;:" and " " in cut:  # (a word goes whole or not at all)
        cut = cut.rsplit(" ", 1)[0]
    return cut.rstrip(" ,;:(") + "…"


def branch_label(branch: Branch) -> str:
    """One branch in a line: ``b1 from step 120 (rewind=120) steps 121-300: lr_scale=0.5``.

    ``b0 steps 1-200`` for the start."""
    text = f"{branch_title(branch)} {_steps(branch)}"
    changes = changes_text(branch)
    return text + (f": {changes}" if changes else "")


def tree_lines(tree: BranchTree, *, width_chars: int = 80,
               max_lines: int = MAX_TREE_LINES) -> list[str]:
    """The tree drawn one branch a line, each under its parent; ``[]`` for a run of one branch.

    Each under its parent (``└``, ``├``), the branch taken last marked ``(latest)``, lines
    cut to ``width_chars``; at most ``max_lines`` lines (the last then counts the branches
    left out)."""
    if len(tree) < 2 and not tree.omitted:
        return []
    children = tree.children()
    lines: list[str] = []
    left = 0
    stack: list[tuple[Branch, str, str]] = [(branch, "", "") for branch in
                                            reversed(children.get(None, []))]
    while stack:
        branch, lead, rest = stack.pop()
        if len(lines) >= max_lines - 1:
            left += 1
            stack += [(child, "", "") for child in children.get(branch.branch, [])]
            continue
        mark = "  (latest)" if branch.branch == tree.current else ""
        line = lead + branch_label(branch) + mark
        lines.append(line if len(line) <= width_chars else line[:width_chars - 1] + "…")
        kids = children.get(branch.branch, [])
        if len(rest) >= 2 * MAX_DEPTH:
            rest = rest[:2 * MAX_DEPTH - 2]
        for index, child in reversed(list(enumerate(kids))):
            last = index == len(kids) - 1
            stack.append((child, rest + ("└ " if last else "├ "),
                          rest + ("  " if last else "│ ")))
    left += tree.omitted
    if left:
        lines.append(f"… {left:,} more branches")
    return lines

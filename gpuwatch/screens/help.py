"""The ``?`` screen: every key of the dashboard with what it does, then what each panel shows.

And what the numbers of each panel mean."""

from __future__ import annotations

from textual.actions import parse as parse_action
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

#: Each panel of the dashboard, top to bottom, and what its numbers mean.
PANELS = (
    ("header", (
        "The run's state (waiting, live, compiling… with the seconds so far "
        "against the run's last compile and the graph Dynamo is at, "
        "stalled: no optimizer step for several step times, paused: held by P "
        "after the step shown, evaluating / saving: at the boundary after it, "
        "running evaluate=now or writing a checkpoint, quiet: nothing "
        "heard but the process lives, gone, ended; replay: a finished run on a "
        "timeline), the last optimizer step (where the charts end), the run's name, "
        "device and id. Shown when not 0: missed (records lost on the way to the "
        "dashboard) and, counted by the run since it started, dropped (records its "
        "queue had no room for), agent "
        "errors, rejected (commands it refused, from any dashboard or client: a bad "
        "token, an unknown knob, a value out of range, a run that is ending; the "
        "event log says why, one a second).")),
    ("step time & data wait", (
        "The time each optimizer step took (GPU time on CUDA, the host clock on "
        "CPU) and, of it, the time the loop waited inside the data loader's "
        "next(), in the unit the axis shows (ms, s or min, as reads best). The title "
        "gives their means over the latest steps that add up to 10 s ('10s mean:'; "
        "fewer seconds when fewer are kept): a slow step weighs its share of them. ▲ "
        "marks a step beyond the axis' end (a "
        "compile, a checkpoint save: an outlier never sets the scale): the title "
        "gives the largest where it fits. Orange lines: knob changes. Both charts show the whole "
        "run from step 1 (its log, read in the background: each column spans its "
        "steps' least and largest value, so spikes show), then live; z: only the "
        "steps received last, and back.")),
    ("loss", (
        "The training loss the run reports, per optimizer step.")),
    ("throughput", (
        "Samples per second (tokens per second for token models) over the kept "
        "steps, from 0; ▲: a few outlying steps drawn full rather than "
        "flattening the rest. The number: over the steps of the step-time title's "
        "mean, what they counted over their time.")),
    ("memory", (
        "CUDA: alloc = held by tensors, rsvd = reserved by PyTorch's caching "
        "allocator, peak = peak reserved, as % of the GPU's memory. RSS: the "
        "training process's host memory. activ: activation memory, the bytes "
        "one micro-batch saves for backward (parameters not counted), measured "
        "every few steps and after each change; 'was' = before the last change. "
        "The bars: the footprint over the last N steps, each bar the largest of "
        "its steps.")),
    ("host & GPU", (
        "CPU: the host, % of all cores; proc: the training process, 100% = one "
        "core busy. RAM of the host. One line per GPU: utilisation, memory "
        "used/total, power/limit, temperature, SM clock; or why there is no GPU "
        "data (gpuwatch doctor tells more).")),
    ("data", (
        "The input verdict: input-bound (the loop waits for data ≥ 50% of the "
        "step time), partly input-bound (≥ 20%), compute-bound (less), over the "
        "agent's window of 20 steps; wait: that share, and one bar per step "
        "(0-100%). From 100 columns; narrower, the verdict heads the knobs "
        "panel's data group.")),
    ("knobs", (
        "Every knob of the run and its value, under its group (numerics, "
        "kernels & memory, data: the loader's, optimizer), green for 10 s after a "
        "change; '-> v (at step N)' while a command waits for its step; lr: the "
        "learning rate the last step used (and lr_scale when not 1); clip: "
        "max_grad_norm and the last gradient norm; mixture: the weights a "
        "gpuopt.mixture.MixtureLoader draws its datasets with, in their order "
        "(:mixture=0.7,0.3 sets them, normalised to sum 1, from the next sample); "
        "recover: loss-spike recovery "
        "with its settings, e.g. on (every 25 x2, 3 steps > 6 MAD, lr x0.5 for 100): "
        "a state kept every 25 steps, the last 2; 3 losses in a row above the median "
        "by 6 robust deviations are a spike, after which the run goes back to the "
        "last state before it, skips the data since and runs at half the lr for 100 "
        "steps. '+N more': the ones that do not fit (: sets any).")),
    ("events", (
        "Commands sent, the run's replies and applied changes, warnings; the "
        "newest line alone when the terminal is short (gpuwatch tail shows "
        "all).")),
)


class HelpScreen(ModalScreen[None]):
    """Lists the app's bindings that act here, how run-changing keys confirm, and the panels.

    The bindings as key, description, longer help; how the keys that change the run confirm
    (``quick_keys``: they do not); then what each panel shows (:data:`PANELS`). Any listed
    key closes."""

    BINDINGS = [
        Binding("escape,q,question_mark", "dismiss", "close", id="help.close"),
        # a line a key, however fast they come (Textual's own scrolls from the target
        # of the last one only after a refresh: a burst of 15 moved one line)
        Binding("down", "scroll_lines(1)", "down", id="help.down", show=False,
                priority=True),
        Binding("up", "scroll_lines(-1)", "up", id="help.up", show=False, priority=True),
    ]

    def __init__(self, *, quick_keys: bool = False, name: str | None = None,
                 id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        #: the dashboard's keys that change the run send at once (else they ask first)
        self.quick_keys = quick_keys

    def compose(self) -> ComposeResult:
        app = self.app
        bindings = [b for b in app.BINDINGS if isinstance(b, Binding)  # those that act
                    and app.check_action(*parse_action(b.action)[1:]) is not False]
        bindings.append(Binding(app.COMMAND_PALETTE_BINDING, "command_palette",
                                "commands", tooltip="Command palette: search every command"))
        with VerticalScroll(id="help"):  # up, down, page up/down, home, end scroll it
            with Grid(id="help-keys"):  # a long help wraps inside its own column
                for binding in bindings:
                    yield Static(Content.styled(app.get_key_display(binding),
                                                "bold $accent"), classes="key")
                    yield Static(Content.styled(binding.description, "bold"),
                                 classes="description")
                    yield Static(binding.tooltip, classes="help")
            yield Static(Content.styled(
                "Keys that change the run send at once (quick keys are on)."
                if self.quick_keys else
                "Keys that change the run ask first, over the footer: the same key "
                "again or enter sends; escape or any other key cancels (a key typed "
                "before the question showed never answers it). Quick keys send at once: "
                "gpuwatch --quick-keys, or GPUWATCH_QUICK_KEYS=1.", "$text-muted"),
                id="help-asks")
            yield Static(Content.styled("panels", "bold $accent"), classes="heading")
            with Grid(id="help-panels"):
                for panel, text in PANELS:
                    yield Static(Content.styled(panel, "bold"), classes="panel")
                    yield Static(text, classes="help")
            yield Static(Content.styled("up/down, page up/down, home/end scroll; escape, q "
                                        "or ? closes this screen", "$text-muted"))

    def action_scroll_lines(self, lines: int) -> None:
        """Scroll the help ``lines`` lines (negative: up) at once, from the last key's place."""
        help_box = self.query_one("#help")
        help_box.scroll_to(y=help_box.scroll_target_y + lines, animate=False,
                           immediate=True)

    def on_mount(self) -> None:
        help_box = self.query_one("#help")
        help_box.border_subtitle = "↑ ↓ pgup pgdn scroll · escape closes"
        help_box.focus()  # the keys scroll it

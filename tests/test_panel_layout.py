"""The knobs panel's layout (every knob under its group, in as few columns as fit), and
the thinning of a chart's long lines."""

from __future__ import annotations

from textual.content import Content

from agent.wire.knobs import GROUPS, OTHER, STANDARD_KNOBS
from gpuwatch.widgets.knobs import KnobGroup, _KnobLine, knob_columns


def test_every_standard_setting_has_a_group_and_sends_it():
    for spec in STANDARD_KNOBS.values():
        assert spec.group in GROUPS
        assert spec.to_wire()["group"] == spec.group
        # other: the commands, and recover (the run's own safety net, in no group of
        # settings that change how it trains)
        assert (spec.group == OTHER) == (spec.command or spec.name == "recover"), spec.name


def _groups(data: tuple[Content, ...] = ()) -> list[KnobGroup]:
    def group(name, *lines, headings=()):
        title = Content(name)
        return KnobGroup(headings[0] if headings else title,
                         tuple(_KnobLine(label, value) for label, value in lines),
                         essential=bool(headings), shorter=tuple(headings[1:]))
    return [group("numerics", ("precision", "fp32"), ("accum_steps", "1")),
            group("data", ("num_workers", "2"), ("pin_memory", "off"),
                  headings=data),
            group("optimizer", ("lr", "0.00100"), ("clip", "1 norm 0.875"))]


def test_columns_under_headings_when_they_fit():
    rows = [row.plain for row in knob_columns(_groups(), 40, 6)]
    assert rows[0].split() == ["numerics", "optimizer"]
    assert rows[1].split() == ["precision", "fp32", "lr", "0.00100"]
    assert rows[3].split() == ["data"]  # a group does not start at a column's end
    assert rows[4].split() == ["num_workers", "2"]


def test_headings_give_way_but_the_verdict_stays_then_the_rest_is_counted():
    verdict = (Content("data compute-bound 3%"), Content("data wait 3%"))
    rows = [row.plain for row in knob_columns(_groups(verdict), 40, 5)]
    text = "\n".join(rows)
    assert "numerics" not in text and "optimizer" not in text
    assert "data compute-bound 3%" in text or "data wait 3%" in text
    assert all(name in text for name in ("precision", "num_workers", "lr", "clip"))
    rows = [row.plain for row in knob_columns(_groups(), 16, 3)]  # one narrow column
    assert len(rows) == 3 and rows[-1] == "+4 more (? or :)"
    assert all(len(row) <= 16 for row in rows)


def test_a_knobs_settings_show_as_far_as_they_fit_in_whole_parts_never_cutting_a_name():
    detail = "every 25 x2, 3 steps > 6 MAD, lr x0.5 for 100"
    groups = [KnobGroup(Content("numerics"), (_KnobLine("micro_batch_size", "16"),)),
              KnobGroup(Content("other"), (_KnobLine("recover", "on", detail=detail),))]
    shown = {width: "\n".join(row.plain for row in knob_columns(groups, width, 4))
             for width in (58, 50, 30, 20)}
    assert f"recover on ({detail})" in shown[58]
    assert "recover on (every 25 x2, 3 steps > 6 MAD, …)" in shown[50]
    assert "recover on (every 25 x2, …)" in shown[30]
    assert "recover on" in shown[20] and "(" not in shown[20]
    assert all("micro_batch_size 16" in text for text in shown.values())


def test_a_long_line_is_thinned_to_its_extremes_per_column_of_dots():
    from gpuwatch.widgets.step_chart import thin

    steps = list(range(1, 601))
    values = [1.0 + (step % 7) * 0.01 for step in steps]
    values[333] = 50.0  # one spike
    kept_steps, kept_values = thin(steps, values, 40)  # 80 columns of dots
    assert len(kept_steps) <= 2 * 80 + 2 and kept_steps == sorted(kept_steps)
    assert (kept_steps[0], kept_steps[-1]) == (1, 600)  # the line's ends stay
    assert 50.0 in kept_values and min(kept_values) == min(values)
    assert thin(steps[:100], values[:100], 40) == (steps[:100], values[:100])  # fits


def test_no_knobs_and_a_huge_verdict_from_the_wire_still_lay_out():
    huge = Content("data " + "x" * 1_000_000)  # a run's input_verdict is any string
    rows = knob_columns([KnobGroup(huge, (), essential=True)], 30, 5)
    assert len(rows) == 1 and rows[0].cell_length <= 30
    assert [row.plain for row in knob_columns([KnobGroup(Content("data"), ())], 30, 5)
            ] == ["data"]

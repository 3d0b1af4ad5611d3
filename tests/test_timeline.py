"""`elastic plot` draws a real journal to a valid PNG with a mark for every kind of event in it."""

import struct
import sys
import zlib

import pytest

from elastic import cli
from elastic.journal.events import make_event
from elastic.journal.run_view import open_run
from elastic.journal.timeline import (
    MARKS,
    PlotUnavailableError,
    collect_marks,
    draw_timeline,
    loss_by_step,
    strategy_label,
    world_size_series,
)
from test_cli_inspect import T0, healed_run_events, write_journal

pytestmark = pytest.mark.timeout(60)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk, after checking the signature and the chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (kind, length) == (b"IHDR", 13)
    width, height = struct.unpack(">II", data[16:24])
    (crc,) = struct.unpack(">I", data[29:33])
    assert crc == zlib.crc32(data[12:29])
    assert data.rstrip()[-8:-4] == b"IEND"
    return width, height


@pytest.fixture
def run(tmp_path):
    write_journal(tmp_path, "lm", healed_run_events())
    return open_run(str(tmp_path), "lm")


def test_a_real_journal_renders_to_a_png_with_every_kind_of_mark_it_holds(run, tmp_path):
    output = tmp_path / "timeline.png"

    drawn = draw_timeline(run.events, str(output), "lm")

    width, height = png_size(output)
    assert width > 800 and height > 500
    assert list(drawn.marks) == ["failure", "heal", "grow", "restart", "checkpoint"]
    assert drawn.marks["failure"] == pytest.approx([11.1, 20.0])
    assert drawn.marks["heal"] == pytest.approx([11.5])
    assert drawn.marks["grow"] == pytest.approx([16.1])
    assert drawn.marks["restart"] == pytest.approx([24.0, 26.0])  # every worker lost; the controller restarted
    assert drawn.marks["checkpoint"] == pytest.approx([10.0, 31.0])
    assert drawn.legend == ["worker failed ×2", "healed (smaller group)", "grew back", "restart ×2",
                            "checkpoint saved ×2", "not training (waiting, reconfiguring)"]
    assert drawn.title == "lm: 100 steps in 31 s, goodput 0.75"


def test_the_png_opens_as_an_image_of_the_size_its_header_says(run, tmp_path):
    image_module = pytest.importorskip("PIL.Image")
    output = tmp_path / "timeline.png"
    draw_timeline(run.events, str(output), "lm")

    with image_module.open(output) as image:
        image.load()
        assert image.format == "PNG"
        assert image.size == png_size(output)


def test_a_run_without_incidents_draws_no_marks_and_says_it_has_not_finished(tmp_path):
    events = healed_run_events()[:10]
    output = tmp_path / "quiet.png"

    drawn = draw_timeline(events, str(output), "lm")

    png_size(output)
    assert drawn.marks == {}
    assert drawn.legend == ["not training (waiting, reconfiguring)"]
    assert drawn.title == "lm: not finished (no run_finished event yet)"


def test_all_attempts_marks_the_start_of_a_later_attempt_as_a_restart(tmp_path):
    later = [{**make_event("run_started", name="lm", attempt="a2", data={"max_steps": 200}), "time": T0 + 100},
             {**make_event("run_resumed", step=100, checkpoint="x/step_100"), "time": T0 + 100.1}]
    events = healed_run_events() + later

    latest = draw_timeline(events, str(tmp_path / "latest.png"), "lm")
    every = draw_timeline(events, str(tmp_path / "all.png"), "lm", all_attempts=True)

    assert latest.marks == {}
    assert every.marks["restart"] == pytest.approx([24.0, 26.0, 100.0])
    assert every.title.startswith("lm: 2 attempts, the last: 100 steps in 31 s, goodput 0.75")
    assert every.title.endswith("(resumed from step 100)")


def test_world_size_steps_at_each_generation_and_drops_to_zero_when_the_run_ends():
    events = healed_run_events()

    times, sizes = world_size_series(events, T0)

    assert sizes == [0, 0, 3, 2, 3, 3, 0, 0, 3, 0, 0]
    assert times[:4] == pytest.approx([0.0, 0.0, 5.4, 11.5])


def test_only_heal_and_grow_reasons_and_later_starts_are_marked_among_formed_generations():
    formed = [make_event("generation_formed", generation=g, world_size=2, reason=r)
              for g, r in [(0, "start: 2 ready workers"), (1, "heal: 2 live"), (2, "grow: 1 ready"), (3, "start: 2")]]
    for event, t in zip(formed, range(4)):
        event["time"] = T0 + t

    assert collect_marks(formed, T0) == {"heal": [1.0], "grow": [2.0], "restart": [3.0]}
    assert set(MARKS) == {"failure", "heal", "grow", "restart", "checkpoint"}


def test_plot_command_writes_the_png_and_names_the_marks(run, tmp_path, capsys):
    output = tmp_path / "cli.png"

    code = cli.main(["plot", "lm", "--storage-path", str(tmp_path), "-o", str(output)])

    out = capsys.readouterr().out
    assert code == 0
    png_size(output)
    assert out == (f"wrote {output}: lm: 100 steps in 31 s, goodput 0.75; "
                   "marks: 2 failure, 1 heal, 1 grow, 2 restart, 2 checkpoint\n")


def test_without_matplotlib_the_error_says_how_to_install_it(run, tmp_path, monkeypatch, capsys):
    for module in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, module, None)  # None in sys.modules makes its import fail

    with pytest.raises(PlotUnavailableError, match=r"pip install 'elastic\[plot\]'"):
        draw_timeline(run.events, str(tmp_path / "x.png"))
    code = cli.main(["plot", "lm", "--storage-path", str(tmp_path), "-o", str(tmp_path / "x.png")])

    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert "elastic plot: drawing a timeline needs matplotlib" in err
    assert not (tmp_path / "x.png").exists()


def _trained(name, losses, strategy=None):
    started = dict(name=name, attempt="a", data={"max_steps": 10 * len(losses)})
    if strategy is not None:
        started["strategy"] = strategy
    events = [make_event("run_started", time=T0, **started)]
    events += [make_event("metrics", time=T0 + i + 1, world_size=2, step=10 * (i + 1), samples_per_s=1.0,
                          metrics={"step": 10 * (i + 1), "loss": loss}) for i, loss in enumerate(losses)]
    return events


def test_compare_draws_each_runs_loss_over_its_steps_and_names_its_techniques(tmp_path, capsys):
    assert loss_by_step(_trained("a", [3.0, 2.0, 1.5])) == ([10, 20, 30], [3.0, 2.0, 1.5])
    assert strategy_label(_trained("a", [1.0], {"precision": "bf16", "compression": "none", "zero": 1,
                                                 "sync": "ddp"})) == "precision=bf16, zero=1"
    assert strategy_label(_trained("a", [1.0])) == "fp32 DDP"
    write_journal(tmp_path, "fp32", _trained("fp32", [3.0, 2.0, 1.5]))
    write_journal(tmp_path, "bf16", _trained("bf16", [3.1, 2.1, 1.6], {"precision": "bf16"}))
    output = tmp_path / "compare.png"

    code = cli.main(["plot", "fp32", "--storage-path", str(tmp_path), "--compare", "bf16", "-o", str(output)])

    assert code == 0 and png_size(output)
    assert capsys.readouterr().out == f"wrote {output}; last loss: fp32 1.5000, bf16 1.6000\n"


def test_compare_refuses_a_run_that_reported_no_loss(tmp_path, capsys):
    write_journal(tmp_path, "fp32", _trained("fp32", [3.0]))
    write_journal(tmp_path, "silent", _trained("silent", []))

    code = cli.main(["plot", "fp32", "--storage-path", str(tmp_path), "--compare", "silent"])

    assert code == 1
    assert "runs ['silent'] reported no loss; elastic.report({'loss': ...})" in capsys.readouterr().err

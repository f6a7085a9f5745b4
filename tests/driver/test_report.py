"""What the end of a run tells the user about the model it hands over."""

from __future__ import annotations

import json

from driver.run import _export_dtype_note


def test_a_float32_export_of_a_bfloat16_model_says_how_to_keep_its_dtype(tmp_path):
    """A user's bfloat16 model came back in float32, twice its size, and nothing said `run.export.dtype` exists."""
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    note = _export_dtype_note(str(tmp_path), None)
    assert f"in float32, the trainer's, while {tmp_path} holds bfloat16: run.export.dtype = 'bfloat16'" in note
    assert _export_dtype_note(str(tmp_path), "bfloat16") == ""  # asked for: nothing to say
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert _export_dtype_note(str(tmp_path), None) == ""
    assert _export_dtype_note(str(tmp_path / "missing"), None) == ""


def test_the_report_names_the_curves_only_when_they_are_plotted(tmp_path, capsys):
    """With run.logging.plot = false the report named a curves.png that was never written."""
    from driver.run import _print_report

    before, after = {"eval/accuracy": 0.4}, {"eval/accuracy": 0.6}
    _print_report(before, after, tmp_path, plotted=False)
    assert "curves:" not in capsys.readouterr().out
    _print_report(before, after, tmp_path, plotted=True)
    assert f"curves: {tmp_path / 'curves.png'}" in capsys.readouterr().out

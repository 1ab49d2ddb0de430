"""``lmforge generate --help`` states the limits its refusals enforce."""
from lmforge.cli import build_parser
from lmforge.cli.common import parsers_under
from lmforge.models.sampling import MIN_TEMPERATURE


def _generate_help() -> str:
    parser = next(p for p in parsers_under(build_parser()) if p.prog.endswith(" generate"))
    return " ".join(parser.format_help().split())


def test_generate_help_states_the_temperature_floor_and_the_seed_range():
    text = _generate_help()
    assert f"0 (greedy) or >= {MIN_TEMPERATURE}, the floor" in text
    assert "sampling seed, 0 to 2**63 - 1" in text


def test_generate_help_says_output_is_written_as_it_goes_and_never_replaces_a_field():
    text = _generate_help()
    assert "an interrupted run keeps the records it finished" in text
    assert "a record that already has one of these is refused" in text


def test_ctrl_c_before_the_decode_ends_the_command_in_one_line_with_130(tmp_path, capsys,
                                                                         monkeypatch):
    """Ctrl-C while the model loads (no handler of the command's own yet): status 130 and
    one line, no traceback, --output untouched."""
    import lmforge.cli.generate as cli_generate
    from lmforge.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli_generate, "load_hf_model", interrupted)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "model").mkdir()
    code = main(["generate", "--model", str(tmp_path / "model"), "--prompts", str(tmp_path / "p.jsonl"),
                 "--output", str(tmp_path / "o.jsonl"), "--device", "cpu"])
    assert code == 130
    assert capsys.readouterr().err == "lmforge: interrupted\n"
    assert not (tmp_path / "o.jsonl").exists()

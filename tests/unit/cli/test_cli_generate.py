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

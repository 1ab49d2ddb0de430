"""lmforge's own warnings reach a user as one plain line; other packages' keep Python's
form (their source line helps their users)."""
import warnings

from lmforge.cli import main, plain_warning
from lmforge.data import sft


def test_an_lmforge_warning_is_one_plain_line():
    line = plain_warning(UserWarning("3 of 40 samples\n dropped"), UserWarning,
                         sft.__file__, 265)
    assert line == "lmforge: warning: 3 of 40 samples dropped\n"


def test_another_packages_warning_keeps_pythons_form():
    line = plain_warning(UserWarning("deprecated"), UserWarning, warnings.__file__, 10)
    assert "UserWarning: deprecated" in line and warnings.__file__ in line


def test_the_command_line_installs_the_plain_form(capsys, monkeypatch):
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after
    assert main([]) == 2  # no command: the help, and the plain form installed
    assert warnings.formatwarning is plain_warning

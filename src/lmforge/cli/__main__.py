"""``python -m lmforge.cli``: the ``lmforge`` command (how torchrun and the tests start it)."""
import sys

from lmforge.cli import main

sys.exit(main())

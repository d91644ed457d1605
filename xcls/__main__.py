"""``python -m xcls`` is the ``xcls`` command."""

import sys

from xcls.cli import run

sys.exit(run())

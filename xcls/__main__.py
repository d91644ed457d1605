"""``python -m xcls`` is the ``xcls`` command."""

import sys

from xcls.cli import main

sys.exit(main())

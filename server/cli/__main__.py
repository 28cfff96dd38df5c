"""``python -m server.cli``: the ``cp-infer`` command (every rank torchrun starts runs this)."""

import sys

from server.cli.command import main

sys.exit(main())

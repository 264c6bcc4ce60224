"""``python -m shardwise.cli``: the ``shardwise`` command without its console script."""

import sys

from .commands import main

sys.exit(main())

"""``python -m examples.dry_run``: see :mod:`examples.dry_run.cli`."""

import sys

from examples.dry_run.cli import main

sys.exit(main())

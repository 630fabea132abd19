"""``python -m fastprefill.cli``: the ``fastprefill`` command."""

import sys

from fastprefill.cli import main

sys.exit(main())

"""``python -m fastprefill.kernels build | status``: compile the C++ kernels, or say which run here."""

import sys

from fastprefill.kernels import _main

sys.exit(_main(sys.argv[1:]))

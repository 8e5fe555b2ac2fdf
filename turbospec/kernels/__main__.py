"""`python -m turbospec.kernels`: build the compiled kernel once (`make setup` runs it); never fails."""

import logging
import sys

from . import failure, load

logging.basicConfig(level=logging.INFO, format="%(message)s")
built = load(verbose="-v" in sys.argv) is not None
print("turbospec kernels: " + ("grouped int8 kernel built" if built else f"pure-torch fallback in use ({failure()})"))

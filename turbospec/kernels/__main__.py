"""`python -m turbospec.kernels`: build the compiled kernel once (`make setup` runs it); never fails."""

import logging
import sys

from . import amx_available, failure, load

logging.basicConfig(level=logging.INFO, format="%(message)s")
built = load(verbose="-v" in sys.argv) is not None
amx = "; AMX kernels in use" if amx_available() else "; no AMX here: torch's int4 and our AVX-512 int8 kernel in use"
fallback = f"pure-torch fallback in use ({failure()})"
print("turbospec kernels: " + ("grouped int8 kernel built" + amx if built else fallback))

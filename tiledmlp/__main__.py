"""``python -m tiledmlp``: the doctor (``tiledmlp-doctor``, :mod:`tiledmlp.integrations.check`)."""

import sys

from tiledmlp.integrations.check import main

if __name__ == "__main__":
    sys.exit(main())

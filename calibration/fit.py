"""``python -m headroom.calibration.fit``: the documented command that rewrites the shipped
``runtime`` and ``hf`` coefficient sets (``calibration.shipped``, which does the work; the
regression itself is ``calibration.regression``). Only a command: nothing to import from here.
"""

from __future__ import annotations

from headroom.calibration.shipped import main

if __name__ == "__main__":
    main()

"""``python -m moe_wave``: see ``moe_wave.cli``."""

import sys

from moe_wave.cli import main

if __name__ == "__main__":
    sys.exit(main())

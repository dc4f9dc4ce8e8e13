"""``python -m moe_wave``: see ``moe_wave.cli``."""

import sys

if __name__ == "__main__":
    try:
        from moe_wave.cli import main

        sys.exit(main())
    except KeyboardInterrupt:      # during the imports, before main's own handler is in place
        print("moe-wave: interrupted", file=sys.stderr)
        sys.exit(130)

"""``python -m moe_wave.deepep_compat``: print the folder to prepend to PYTHONPATH so that ``import deep_ep`` gives
moe-wave's implementation. A real DeepEP that it would hide is named on stderr (the choice stays the caller's).

    export PYTHONPATH=$(python -m moe_wave.deepep_compat):$PYTHONPATH
"""

from __future__ import annotations

import sys

from . import real_deep_ep, shim_path


def main() -> int:
    real = real_deep_ep()
    if real is not None:
        print(f"note: a real DeepEP is installed ({real}); with this folder first on PYTHONPATH, `import deep_ep` "
              f"gives moe-wave's instead", file=sys.stderr)
    print(shim_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())

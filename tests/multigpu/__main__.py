"""``python -m tests.multigpu``: run the multi-GPU acceptance kit and print its table (tests/multigpu/kit.py)."""

import sys

from tests.multigpu.kit import main

sys.exit(main())

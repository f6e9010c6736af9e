"""``python -m benchmarks.peers``: see the package's rules."""

import sys

from .run import main

sys.exit(main())

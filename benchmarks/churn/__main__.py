"""``python -m benchmarks.churn``: see the package's rules."""

import sys

from .run import main

sys.exit(main())

"""``python -m isolators`` is the ``gpu-isolator`` command."""

import sys

from .cli import main

sys.exit(main())

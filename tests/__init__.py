"""The test suite; ``tests.support`` holds the helpers tests import (pytest
puts the repository root on ``sys.path``: ``pythonpath`` in pyproject.toml)."""

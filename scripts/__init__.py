"""Scripts run from a checkout (``python -m scripts.NAME``), not installed with the package."""

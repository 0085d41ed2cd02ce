"""Measurement and maintenance scripts, run as `python -m tools.NAME` from the repository root."""

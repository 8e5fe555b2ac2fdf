"""Data sets from PyPI packages and request arrival patterns: what benchmarks, training and calibration read."""

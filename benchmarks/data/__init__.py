"""Benchmark inputs written for these scripts (imported as `data`, benchmarks/ being the script's directory)."""

"""The parts of benchmarks/cppo_table.py (the CPPO paper table), one job per module."""

"""The paper's comparison at small scale (benchmarks/reproduce.py): modes, arms, runs, report."""

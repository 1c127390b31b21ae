"""Files, checkpoints, metrics and processes: what a run reads and writes."""

"""The framework-neutral monitor: which batches to record, what to record, and when."""

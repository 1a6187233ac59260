"""Attention out of real models: hooks and function modes, one reader per attention path,
the consumers of each call and the offline evaluator. Never a training framework."""

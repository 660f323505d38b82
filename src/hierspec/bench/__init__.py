"""Benchmarking: Spec-Bench-format questions, methods timed in one process, answers and reports."""

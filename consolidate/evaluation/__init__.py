"""Evaluation: dataset tasks, metrics, retrieval before/after consolidation, calibration."""

"""Datasets, preprocessing, models and metrics per task."""

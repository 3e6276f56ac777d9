"""Datasets, preprocessing, models and metrics per task."""

import pipeline  # noqa: F401  (stops TFF's workers at exit)

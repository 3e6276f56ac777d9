"""Federated algorithms: TF math (`math.py`) and TFF processes (`definition.py`)."""

import pipeline  # noqa: F401  (stops TFF's workers at exit)

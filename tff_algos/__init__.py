"""Federated algorithms: TF math (`math.py`) and round definitions
(`definition.py`), run by `runtime`."""

import pipeline  # noqa: F401  (stops TFF's workers at exit)

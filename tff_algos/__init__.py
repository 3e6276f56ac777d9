"""Federated algorithms: pure-TF update logic (`*_tf.py`) + TFF processes."""

"""Scripted experiments: the papers' claims, reproduced on data available here."""

from pipeline import tf_logs

# Before anything imports TensorFlow (the FedRes experiments train in this
# process): its C++ import noise is filtered, as for the binaries.
tf_logs.quiet_tensorflow_import()

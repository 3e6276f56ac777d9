"""absl binaries: train, evaluate, export, plot, benchmark."""

import sys

from pipeline import tf_logs

# Before anything imports TensorFlow: its C++ import noise is filtered and
# its C++ log level set to errors only (pipeline/tf_logs.py has the switches).
tf_logs.quiet_tensorflow_import(sys.argv)

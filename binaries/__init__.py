"""absl binaries: train, evaluate, export, plot, serve_personalized, benchmark."""

import sys

from pipeline import interrupts
from pipeline import tf_logs

interrupts.exit_at_once_while_starting()

# Before anything imports TensorFlow: its C++ import noise is filtered and
# its C++ log level set to errors only (pipeline/tf_logs.py has the switches).
tf_logs.quiet_tensorflow_import(sys.argv)

"""Scripted experiments: the papers' claims, reproduced on data available here."""

from pipeline import interrupts
from pipeline import tf_logs

# A Ctrl-C or SIGTERM while an experiment imports TensorFlow: its one line
# (a SIGTERM killed it with none), until `cli.run_main` takes over.
interrupts.exit_at_once_while_starting()

# Before anything imports TensorFlow (the FedRes experiments train in this
# process): its C++ import noise is filtered, as for the binaries.
tf_logs.quiet_tensorflow_import()

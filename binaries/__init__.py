"""absl binaries: train, evaluate, export, plot, serve_personalized, benchmark."""

import os
import sys

from pipeline import interrupts
from pipeline import tf_logs

# A stream the shell closed (`>&-`, `2>&-`) is None in Python: every print,
# flush or isatty on it failed (status 1 after the work was done). Its
# output goes nowhere instead, as the user asked.
for _name in ('stdout', 'stderr'):
  if getattr(sys, _name) is None:
    setattr(sys, _name, open(os.devnull, 'w', encoding='utf-8'))  # pylint: disable=consider-using-with

interrupts.exit_at_once_while_starting()

# Before anything imports TensorFlow: its C++ import noise is filtered and
# its C++ log level set to errors only (pipeline/tf_logs.py has the switches).
tf_logs.quiet_tensorflow_import(sys.argv)

"""absl binaries: train, evaluate, export, plot."""

import os

# Must precede the first TensorFlow import: hide C++ INFO/WARNING chatter
# (TensorRT probing, graph-optimizer notes) from every binary's output.
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

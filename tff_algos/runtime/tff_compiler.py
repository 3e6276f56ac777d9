"""Compiles computations for TFF's C++ runtime: TFF 0.87's own pipeline, with
TensorFlow's graph optimizer (grappler) configured per computation.

TFF 0.87's native contexts compile with `desugar_and_transform_to_native`,
which runs grappler on every TF computation before it goes to a worker, with
one configuration: memory optimization, constant folding, arithmetic, loop
and function optimization all AGGRESSIVE. Two kinds of computations made it
log errors, which `compile_for_native_runtime` avoids at their cause:

- A computation that trains in a loop (a group of clients building their
  datasets in its own graph, `runtime/cohort.py`; mixed FL's central
  update): the memory optimizer at AGGRESSIVE (= HEURISTICS) includes its
  recomputation heuristics, which rewrite the gradient ops inside the
  training loop so that the function optimizer's next pass rejects the graph
  (`function_optimizer failed: INVALID_ARGUMENT: ... has inputs from
  different frames`). Such computations are traced with
  `mark_without_recomputation` and compiled with the memory optimizer at
  DEFAULT_MEM_OPT: its scheduling and swapping heuristics without
  recomputation, which only trades compute for accelerator memory.
- A computation without outputs (e.g. an algorithm's empty client state):
  grappler has no fetch node to optimize for (`Failed to detect the fetch
  node(s)`) and TFF falls back to the unoptimized graph; it is not run.

Every other computation compiles exactly as TFF's pipeline compiles it
(tests/test_tff_compiler.py). The pipeline itself is TFF's internals, in
`tff_algos/tff_internals.py`; this module only chooses the configuration.
"""

import tensorflow as tf

from tff_algos import tff_internals

# A node (never run: nothing depends on it) that marks a graph for
# `without_recomputation`. Merged graphs keep it under a name scope.
_NO_RECOMPUTATION_MARKER = 'tff_algos_without_recomputation_heuristics'


def tff_grappler_config() -> tf.compat.v1.ConfigProto:
  """The grappler configuration of TFF 0.87's
  `tff.backends.native` compiler (`desugar_and_transform_to_native`)."""
  config = tf.compat.v1.ConfigProto()
  options = config.graph_options.rewrite_options
  options.memory_optimization = options.AGGRESSIVE
  options.constant_folding = options.AGGRESSIVE
  options.arithmetic_optimization = options.AGGRESSIVE
  options.loop_optimization = options.AGGRESSIVE
  options.function_optimization = options.AGGRESSIVE
  return config


def _config_without_recomputation() -> tf.compat.v1.ConfigProto:
  config = tff_grappler_config()
  options = config.graph_options.rewrite_options
  options.memory_optimization = options.DEFAULT_MEM_OPT
  return config


def mark_without_recomputation() -> None:
  """Marks the TF computation being traced to compile without the memory
  optimizer's recomputation heuristics."""
  tf.no_op(name=_NO_RECOMPUTATION_MARKER)


def _optimized(computation):
  """Grappler on one TF computation, with the configuration it needs (None:
  not a TF computation, or one without outputs, left as it is)."""
  graph_def = tff_internals.tensorflow_graph_def(computation)
  if graph_def is None or not tff_internals.has_outputs(computation):
    return None  # No output: nothing to optimize for.
  marked = any(node.name.endswith(_NO_RECOMPUTATION_MARKER)
               for node in graph_def.node)
  return tff_internals.optimize_tensorflow(
      computation, _config_without_recomputation() if marked else
      tff_grappler_config())


def compile_for_native_runtime(computation):
  """The `compiler_fn` of this project's TFF execution contexts: TFF's
  `desugar_and_transform_to_native` with `_optimized`'s per-computation
  grappler (`tff_internals.compile_to_native`). Secure sums
  (`--aggregator=secure`) become the plain sums with bound checks that TFF's
  test contexts run: the C++ runtime has no secure-summation protocol."""
  return tff_internals.compile_to_native(computation, _optimized)

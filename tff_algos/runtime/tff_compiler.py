"""Compiles computations for TFF's C++ runtime: TFF 0.87's own pipeline, with
TensorFlow's graph optimizer (grappler) configured per computation.

TFF 0.87's native contexts compile with `desugar_and_transform_to_native`,
which runs grappler on every TF computation before it goes to a worker, with
one configuration: memory optimization, constant folding, arithmetic, loop
and function optimization all AGGRESSIVE. Two kinds of computations made it
log errors, which `compile_for_native_runtime` avoids at their cause:

- A computation that trains in a loop (a group of clients building their
  datasets in its own graph, `runtime/cohort.py`; mixed FL's central
  update): the memory
  optimizer at AGGRESSIVE (= HEURISTICS) includes its recomputation
  heuristics, which rewrite the gradient ops inside the training loop so that
  the function optimizer's next pass rejects the graph (`function_optimizer
  failed: INVALID_ARGUMENT: ... has inputs from different frames`). Such
  computations are marked with `without_recomputation` and compiled with the
  memory optimizer at DEFAULT_MEM_OPT: its scheduling and swapping heuristics
  without recomputation, which only trades compute for accelerator memory.
- A computation without outputs (e.g. an algorithm's empty client state):
  grappler has no fetch node to optimize for (`Failed to detect the fetch
  node(s)`) and TFF falls back to the unoptimized graph; it is not run.

Every other computation compiles exactly as TFF's pipeline compiles it
(tests/test_tff_compiler.py).
"""

import tensorflow as tf
from tensorflow_federated.proto.v0 import computation_pb2
from tensorflow_federated.python.core.backends.native import compiler as native_compiler
from tensorflow_federated.python.core.backends.test import compiler as secure_intrinsics
from tensorflow_federated.python.core.environments.tensorflow_backend import compiled_computation_transformations
from tensorflow_federated.python.core.environments.tensorflow_backend import tensorflow_tree_transformations
from tensorflow_federated.python.core.impl.compiler import building_blocks
from tensorflow_federated.python.core.impl.compiler import transformation_utils
from tensorflow_federated.python.core.impl.compiler import transformations
from tensorflow_federated.python.core.impl.computation import computation_impl
from tensorflow_federated.python.core.impl.context_stack import context_stack_impl
from tensorflow_federated.python.core.impl.utils import tensorflow_utils
from tensorflow_federated.python.tensorflow_libs import serialization_utils

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


def _graph_def(computation: building_blocks.CompiledComputation):
  return serialization_utils.unpack_graph_def(
      computation.proto.tensorflow.graph_def)


def mark_without_recomputation() -> None:
  """Marks the TF computation being traced for `without_recomputation`."""
  tf.no_op(name=_NO_RECOMPUTATION_MARKER)


def without_recomputation(computation: building_blocks.CompiledComputation
                          ) -> building_blocks.CompiledComputation:
  """`computation`, marked to compile without the memory optimizer's
  recomputation heuristics."""
  graph_def = _graph_def(computation)
  graph_def.node.add(name=_NO_RECOMPUTATION_MARKER, op='NoOp')
  proto = computation_pb2.Computation()
  proto.CopyFrom(computation.proto)
  proto.tensorflow.graph_def.CopyFrom(
      serialization_utils.pack_graph_def(graph_def))
  return building_blocks.CompiledComputation(
      proto, type_signature=computation.type_signature)


def _is_tensorflow(computation) -> bool:
  return (isinstance(computation, building_blocks.CompiledComputation) and
          computation.proto.WhichOneof('computation') == 'tensorflow')


def _optimized(computation):
  """Grappler on one TF computation, with the configuration it needs."""
  if not _is_tensorflow(computation):
    return computation, False
  if not tensorflow_utils.extract_tensor_names_from_binding(
      computation.proto.tensorflow.result):
    return computation, False  # No output: nothing to optimize for.
  marked = any(node.name.endswith(_NO_RECOMPUTATION_MARKER)
               for node in _graph_def(computation).node)
  config = (_config_without_recomputation() if marked else
            tff_grappler_config())
  return compiled_computation_transformations.optimize_tensorflow_comp(
      computation, config), True


def compile_for_native_runtime(computation: computation_impl.ConcreteComputation
                               ) -> computation_impl.ConcreteComputation:
  """The `compiler_fn` of this project's TFF execution contexts.

  TFF's `desugar_and_transform_to_native`, step for step (intrinsics
  replaced by their bodies, call-dominant form, grappler, grappler disabled
  in call ops, cache ids), with `_optimized`'s per-computation grappler.
  The C++ runtime has no secure-summation protocol: secure sums
  (`--aggregator=secure`) become the plain sums with bound checks that TFF's
  test contexts run.
  """
  computation = secure_intrinsics.replace_secure_intrinsics_with_bodies(
      computation)
  desugared, _ = tensorflow_tree_transformations.replace_intrinsics_with_bodies(
      computation.to_building_block())
  call_dominant = transformations.to_call_dominant(desugared)
  optimized, _ = transformation_utils.transform_postorder(call_dominant,
                                                         _optimized)
  return native_compiler.transform_to_native_form(
      computation_impl.ConcreteComputation(
          computation_proto=optimized.proto,
          context_stack=context_stack_impl.context_stack),
      grappler_config=None)

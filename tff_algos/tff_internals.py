"""Every use of TFF's non-public parts, in one place, for one TFF version.

The project pins tensorflow-federated 0.87.0. Nothing outside this module
imports `tensorflow_federated.python` or `.proto` modules or touches a TFF
object's private attributes (tests/test_tff_internals.py checks the
sources). What is used, and for what:

- tff.learning's rules for non-finite values (a client's non-finite update
  is zeroed with weight 0; the finalizer rejects a non-finite mean update),
  so FedAvg and FedSGD compute exactly what tff.learning computes;
- the native backend's compiler pipeline (`desugar_and_transform_to_native`),
  rebuilt step for step in `compile_to_native` with a per-computation
  grappler pass (`runtime/tff_compiler.py` chooses its configuration);
- the execution-context plumbing of `pipeline/tff_runtime.py`: the argument
  transforms TFF's own native contexts are built with, the gRPC channel
  options of TFF's worker channels, the default context's reset, and the
  `ServiceManager` objects (local to `local_cpp_executor_factory`) of the
  contexts TFF builds itself, whose workers are stopped and whose `__del__`
  is disarmed;
- the mergeable execution context: its two partitioning bugs and its
  merge in completion order, patched, and sums merged in this process
  rather than by a call to a worker (`fix_mergeable_context`), and its
  contexts' base class, for contexts that run a sub-round in a thread of
  their own (`threaded_async_context`);
- the Keras model and losses inside a `tff.learning` model made by
  `tff.learning.models.from_keras_model`, and the Keras metric inside each of
  its metric finalizers;
- parts of TFF's simulation baselines the Stack Overflow tasks reuse (its
  masked accuracy; the word prediction task's preprocessing and model,
  whose public builder loads the vocabulary without a cache directory).

These modules are all loaded by `import tensorflow_federated` itself, so
importing this one costs nothing more. Importing it checks the version, so
an upgrade fails here, loudly, rather than somewhere inside a round.
"""

import asyncio
import gc
import subprocess
import threading
import types

import tensorflow as tf
import tensorflow_federated as tff

SUPPORTED_VERSION = '0.87.0'
if tff.__version__ != SUPPORTED_VERSION:
  raise ImportError(
      f'tff_algos uses private parts of tensorflow-federated '
      f'{SUPPORTED_VERSION} (tff_algos/tff_internals.py); found '
      f'{tff.__version__}')

# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
# pylint: disable=protected-access
from tensorflow_federated.python.common_libs import structure
from tensorflow_federated.python.core.backends.native import compiler as native_compiler
from tensorflow_federated.python.core.backends.native import mergeable_comp_compiler
from tensorflow_federated.python.core.backends.test import compiler as test_compiler
from tensorflow_federated.python.core.environments.tensorflow_backend import compiled_computation_transformations
from tensorflow_federated.python.core.environments.tensorflow_backend import tensorflow_tree_transformations
from tensorflow_federated.python.core.environments.tensorflow_frontend import tensorflow_computation
from tensorflow_federated.python.core.impl.compiler import building_blocks
from tensorflow_federated.python.core.impl.compiler import transformation_utils
from tensorflow_federated.python.core.impl.compiler import transformations
from tensorflow_federated.python.core.impl.computation import computation_impl
from tensorflow_federated.python.core.impl.context_stack import context_base
from tensorflow_federated.python.core.impl.context_stack import context_stack_impl
from tensorflow_federated.python.core.impl.context_stack import set_default_context
from tensorflow_federated.python.core.impl.execution_contexts import mergeable_comp_execution_context as mergeable
from tensorflow_federated.python.core.impl.executor_stacks import executor_factory
from tensorflow_federated.python.core.impl.types import computation_types
from tensorflow_federated.python.core.impl.types import type_conversions
from tensorflow_federated.python.core.impl.utils import tensorflow_utils
from tensorflow_federated.python.learning.metrics import keras_finalizer
from tensorflow_federated.python.learning.templates import apply_optimizer_finalizer
from tensorflow_federated.python.simulation.baselines import keras_metrics
from tensorflow_federated.python.simulation.baselines.stackoverflow import word_prediction_models
from tensorflow_federated.python.simulation.baselines.stackoverflow import word_prediction_preprocessing
from tensorflow_federated.python.simulation.baselines.stackoverflow import word_prediction_tasks
from tensorflow_federated.python.tensorflow_libs import serialization_utils
# pylint: enable=g-import-not-at-top,g-bad-import-order,wrong-import-position

# --- tff.learning ------------------------------------------------------------

# (optimizer_state, update) -> (reject?, measurements): tff.learning's
# finalizer rejects a non-finite update, keeping weights and state.
reject_non_finite_update = apply_optimizer_finalizer.reject_non_finite_update


def keras_model_of(model):
  """The Keras model inside a `from_keras_model` model, else None."""
  return getattr(model, '_keras_model', None)


# tff.learning's Keras model wraps these methods in tf.functions with
# AutoGraph, which converts their Python source (and the Keras metrics'
# update_state they call) the first time a process traces them: about 2.5 s
# of a run's first round here, paid again by every new process. They branch
# only on Python values, so they trace to the same ops without it.
_KERAS_MODEL_FUNCTIONS = ('forward_pass', 'predict_on_batch', 'reset_metrics',
                          'report_local_unfinalized_metrics')


def without_autograph(model):
  """A `from_keras_model` model whose methods trace without AutoGraph (the
  same ops, no conversion); any other model unchanged."""
  if keras_model_of(model) is None:
    return model
  for name in _KERAS_MODEL_FUNCTIONS:
    function = getattr(type(model), name, None)
    python_function = getattr(function, 'python_function', None)
    if python_function is not None:
      # do_not_convert also keeps the Keras metrics' update_state, which
      # converts itself unless AutoGraph is off around it, unconverted.
      setattr(model, name, tf.function(
          tf.autograph.experimental.do_not_convert(
              types.MethodType(python_function, model)), autograph=False))
  return model


def keras_losses_of(model) -> list:
  """The Keras loss functions of a `from_keras_model` model."""
  return list(model._loss_fns)


def keras_metric_of_finalizer(finalizer):
  """A new Keras metric like the one a `tff.learning` Keras metric
  finalizer (`keras_finalizer.create_keras_metric_finalizer`) builds at each
  call, or None for any other finalizer. The metric (or its constructor)
  is the finalizer's only closure variable, `metric`."""
  python_function = getattr(finalizer, 'python_function', None)
  code = getattr(python_function, '__code__', None)
  if (code is None or python_function.__module__ != keras_finalizer.__name__
      or code.co_freevars != ('metric',)):
    return None
  return keras_finalizer.create_keras_metric(
      python_function.__closure__[0].cell_contents)


# --- Simulation baselines ----------------------------------------------------

# Keras accuracy that ignores the given token ids.
MaskedCategoricalAccuracy = keras_metrics.MaskedCategoricalAccuracy
# The Stack Overflow word prediction baseline's parts.
create_word_prediction_task_from_datasets = (
    word_prediction_tasks.create_word_prediction_task_from_datasets)
get_special_tokens = word_prediction_preprocessing.get_special_tokens
create_recurrent_model = word_prediction_models.create_recurrent_model

# --- Compiler ------------------------------------------------------------------


def tensorflow_graph_def(computation):
  """The GraphDef of a TF computation (a building block), else None."""
  if not (isinstance(computation, building_blocks.CompiledComputation) and
          computation.proto.WhichOneof('computation') == 'tensorflow'):
    return None
  return serialization_utils.unpack_graph_def(
      computation.proto.tensorflow.graph_def)


def has_outputs(computation) -> bool:
  """Whether a TF computation (a building block) returns any tensor."""
  return bool(tensorflow_utils.extract_tensor_names_from_binding(
      computation.proto.tensorflow.result))


def optimize_tensorflow(computation, grappler_config):
  """Grappler, with `grappler_config`, on one TF computation."""
  return compiled_computation_transformations.optimize_tensorflow_comp(
      computation, grappler_config)


def compile_to_native(computation, transform_tensorflow):
  """TFF 0.87's `desugar_and_transform_to_native`, step for step (secure
  intrinsics and then all intrinsics replaced by their bodies, call-dominant
  form, grappler, grappler disabled in call ops, cache ids), with
  `transform_tensorflow(building block) -> building block or None` (None:
  unchanged) in place of its one grappler pass.

  The C++ runtime has no secure-summation protocol: secure sums become the
  plain sums with bound checks that TFF's test contexts run.
  """

  def transform(block):
    transformed = transform_tensorflow(block)
    return (block, False) if transformed is None else (transformed, True)

  computation = test_compiler.replace_secure_intrinsics_with_bodies(
      computation)
  desugared, _ = tensorflow_tree_transformations.replace_intrinsics_with_bodies(
      computation.to_building_block())
  transformed, _ = transformation_utils.transform_postorder(
      transformations.to_call_dominant(desugared), transform)
  return native_compiler.transform_to_native_form(
      computation_impl.ConcreteComputation(
          computation_proto=transformed.proto,
          context_stack=context_stack_impl.context_stack),
      grappler_config=None)


# --- Execution contexts ------------------------------------------------------

# The channel options of TFF's own worker channels (2 GB messages), which
# TFF 0.87 keeps private; its remote-context helpers were removed.
GRPC_CHANNEL_OPTIONS = executor_factory._GRPC_CHANNEL_OPTIONS


def dispose_no_executor(channel, timeout: float) -> None:
  """Asks the server on `channel` to dispose of no executor: a no-op a TFF
  worker answers OK, and a call any other gRPC service refuses
  (UNIMPLEMENTED). Raises grpc.RpcError as the call does."""
  from tensorflow_federated.proto.v0 import executor_pb2
  from tensorflow_federated.proto.v0 import executor_pb2_grpc
  executor_pb2_grpc.ExecutorGroupStub(channel).DisposeExecutor(
      executor_pb2.DisposeExecutorRequest(), timeout=timeout)


def native_context(context_class, executor_fn, compiler_fn):
  """A `context_class` context built as TFF builds its native contexts (its
  argument transforms), compiled with `compiler_fn`."""
  return context_class(
      executor_fn=executor_fn, compiler_fn=compiler_fn,
      transform_args=tensorflow_computation.transform_args,
      transform_result=tensorflow_computation.transform_result)


def set_no_default_context() -> None:
  set_default_context.set_no_default_context()


def _is_service_manager_class(cls: type) -> bool:
  # TFF defines its ServiceManager class inside local_cpp_executor_factory,
  # a new class per factory: recognized by name and module.
  return (cls.__name__ == 'ServiceManager' and
          cls.__module__ == executor_factory.__name__)


def _disarm(service_manager_class: type) -> None:
  service_manager_class.__del__ = lambda self: None


def _service_managers() -> list:
  return [obj for obj in gc.get_objects()
          if _is_service_manager_class(type(obj))]


def detach_service_manager_workers() -> list[subprocess.Popen]:
  """The running workers of TFF-built local contexts, which forget them (the
  caller stops them)."""
  processes = []
  for manager in _service_managers():
    process = getattr(manager, '_process', None)
    if process is not None and process.poll() is None:
      processes.append(process)
    manager._process = None
  return processes


def disarm_idle_service_manager(context) -> bool:
  """Disarms TFF's one ServiceManager and returns True if it is `context`'s
  and never started a worker; False (nothing done) otherwise.

  Found without a scan of every object: each `local_cpp_executor_factory`
  call defines its own ServiceManager class, so one class alive means one
  manager. Then a shutdown has nothing else to release.
  """
  classes = [c for c in object.__subclasses__()
             if _is_service_manager_class(c)]
  if len(classes) != 1:
    return False
  try:
    cells = (context._async_context._executor_factory._executor_stack_fn
             .__closure__) or ()
    contents = [cell.cell_contents for cell in cells]
  except (AttributeError, ValueError):  # Not a TFF-built local context.
    return False
  managers = [c for c in contents if type(c) is classes[0]]  # pylint: disable=unidiomatic-typecheck
  if len(managers) != 1 or managers[0]._process is not None:
    return False
  _disarm(classes[0])
  return True


def disarm_service_managers() -> None:
  """Makes the `__del__` of live ServiceManagers (whose workers are stopped)
  a no-op: at interpreter teardown it would print an AttributeError."""
  for manager in _service_managers():
    manager._process = None
    _disarm(type(manager))


def fix_mergeable_context() -> None:
  """Fixes three faults of TFF 0.87's mergeable context.

  1. `_partition_value` takes the partition bookkeeping of a struct from its
     *last* element, so when a non-CLIENTS value follows the clients' values
     (as in `next(server_state, client_inputs, server_seed)`) every sub-round
     gets the first sub-round's clients.
  2. `_invoke_after_merge_in_async_pool` concatenates the sub-rounds'
     CLIENTS-placed results in completion order, so client outputs (new
     client states) come back permuted against the client inputs.
  3. `_invoke_merge_in_async_pool` merges the sub-rounds' aggregates in the
     order they complete, so with sub-rounds running at the same time (several
     workers, or several on one) float sums, and so results, change from run
     to run. Merged in sub-round order, a run gives the same bits whichever
     sub-round finishes first: those of its sub-rounds run one by one.
  All three are private functions the module looks up at call time; the
  fixed versions below replace them. Idempotent.

  The merge of two sub-rounds' aggregates is also made in this process when
  the merge computation adds its two arguments leaf by leaf (`adds_leafwise`:
  every `tff.federated_sum`, so every aggregation here but a `tff.aggregators`
  factory's), with TF's add, the worker's kernel and bits. TFF's call to a
  worker moved both aggregates in and the sum out: at 1000 clients in ten
  sub-rounds, 0.14 s a merge for FedAvg and 0.28 s for SCAFFOLD (two
  model-sized sums), nine merges a round.
  """
  if getattr(mergeable, '_project_fixed', False):
    return
  partition_leaf = mergeable._partition_value

  def partition_value(val, type_signature):
    if not isinstance(type_signature, computation_types.StructType):
      return partition_leaf(val, type_signature)
    elements = []
    advanced = val  # Bookkeeping of the element that held clients' values.
    for (_, value), (name, element_type) in zip(
        structure.iter_elements(structure.from_container(val.payload)),
        structure.iter_elements(type_signature)):
      result = partition_value(
          mergeable._PartitioningValue(
              value, val.num_remaining_clients, val.num_remaining_partitions,
              val.last_client_index), element_type)
      elements.append((name, result.payload))
      if result.num_remaining_partitions != val.num_remaining_partitions:
        advanced = result
    return mergeable._PartitioningValue(
        structure.Struct(elements), advanced.num_remaining_clients,
        advanced.num_remaining_partitions, advanced.last_client_index)

  def indexed_task_fn(run_one):
    """TFF's task functions take an argument; these take (index, argument)
    and return (index, result)."""

    def task_fn(indexed_arg, context):
      index, arg = indexed_arg

      async def run():
        return index, await run_one(arg, context)

      return asyncio.create_task(run())

    return task_fn

  async def merge_two(comp, first, second, context):
    if adds_leafwise(comp.merge):
      return _add_leafwise(comp.merge, first, second)
    return await mergeable._merge_results(comp, first, second, context)

  async def merge_in_argument_order(comp, arg_list, execution_contexts):
    done = {}  # Sub-rounds finished before an earlier one.
    merged = 0  # Sub-rounds merged so far.

    async def merge_ready(result, indexed_result, context):
      nonlocal merged
      index, partial = indexed_result
      done[index] = partial
      while merged in done:
        partial = done.pop(merged)
        result = partial if merged == 0 else await merge_two(
            comp, result, partial, context)
        merged += 1
      return result

    return await mergeable._run_in_async_context_pool(
        indexed_task_fn(lambda arg, context: (
            mergeable._invoke_up_to_merge_and_return_context(
                comp, arg, context))),
        list(enumerate(arg_list)), execution_contexts, None, merge_ready)

  async def after_merge_in_argument_order(comp, merge_result, arg_list,
                                          execution_contexts):

    async def collect(results, indexed_result, context):
      del context
      return (*results, indexed_result)

    results, _ = await mergeable._run_in_async_context_pool(
        indexed_task_fn(lambda arg, context: mergeable._compute_after_merged(
            comp, arg, merge_result, context)),
        list(enumerate(arg_list)), execution_contexts, (), collect)
    return [result for _, result in sorted(results, key=lambda r: r[0])]

  mergeable._partition_value = partition_value
  mergeable._invoke_merge_in_async_pool = merge_in_argument_order
  mergeable._invoke_after_merge_in_async_pool = after_merge_in_argument_order
  mergeable._project_fixed = True


# id(merge computation) -> (the computation, whether it adds leaf by leaf).
_LEAFWISE_SUMS: dict[int, tuple[object, bool]] = {}
_LEAFWISE_SUMS_LOCK = threading.Lock()


def adds_leafwise(merge) -> bool:
  """Whether a mergeable form's `merge` computation (<A, A> -> A) returns
  a_i + b_i (TF's AddV2) for every tensor i of A and nothing else.

  Read off its graph: each result tensor, through Identity ops, is an AddV2
  of the two arguments' i-th placeholders, in that order, with no control
  input on the way. Anything else (a factory's merge, a cast, a constant, an
  assertion) is False, and such merges stay TFF calls."""
  with _LEAFWISE_SUMS_LOCK:
    known = _LEAFWISE_SUMS.get(id(merge))
    if known is None or known[0] is not merge:
      known = (merge, _reads_as_leafwise_sum(merge))
      _LEAFWISE_SUMS[id(merge)] = known
    return known[1]


def merge_computation(computation):
  """The `merge` of `computation`'s mergeable form, as TFF's mergeable
  context compiles it."""
  return mergeable_comp_compiler.compile_to_mergeable_comp_form(
      computation).merge


def _reads_as_leafwise_sum(merge) -> bool:
  try:
    proto = computation_impl.ConcreteComputation.get_proto(merge)
  except Exception:  # pylint: disable=broad-except
    return False
  signature = merge.type_signature
  parameter = signature.parameter
  if (proto.WhichOneof('computation') != 'tensorflow' or
      not isinstance(parameter, computation_types.StructType) or
      len(parameter) != 2 or
      not parameter[0].is_equivalent_to(parameter[1]) or
      not parameter[0].is_equivalent_to(signature.result)):
    return False
  bindings = proto.tensorflow
  if bindings.parameter.WhichOneof('binding') != 'struct':
    return False
  arguments = [tensorflow_utils.extract_tensor_names_from_binding(element)
               for element in bindings.parameter.struct.element]
  results = tensorflow_utils.extract_tensor_names_from_binding(
      bindings.result)
  if len(arguments) != 2 or not (
      len(arguments[0]) == len(arguments[1]) == len(results)):
    return False
  nodes = {node.name: node for node in serialization_utils.unpack_graph_def(
      bindings.graph_def).node}

  def producer(tensor_name):
    """The node making a tensor, past Identity ops; None if it is not a
    single-output node's only tensor, or if a control input (an assertion,
    a print) is on the way."""
    name, _, index = tensor_name.partition(':')
    node = nodes.get(name)
    while index in ('', '0') and node is not None and node.op == 'Identity':
      if len(node.input) != 1 or node.input[0].startswith('^'):
        return None
      name, _, index = node.input[0].partition(':')
      node = nodes.get(name)
    return node if index in ('', '0') else None

  for result, first, second in zip(results, *arguments):
    add = producer(result)
    first, second = producer(first), producer(second)
    if (add is None or add.op != 'AddV2' or len(add.input) != 2 or
        first is None or second is None or first.op != 'Placeholder' or
        second.op != 'Placeholder' or first.name == second.name):
      return False
    # In this order: a + b and b + a differ in which NaN they return.
    if [getattr(producer(i), 'name', None) for i in add.input] != [
        first.name, second.name]:
      return False
  return True


def _add_leafwise(merge, first, second):
  """`merge(first, second)` for a leafwise sum, in this process with TF's
  AddV2 (as the worker adds: flushing subnormal floats to zero, unlike
  NumPy), in the structure TFF's call returns."""
  result_type = merge.type_signature.result
  leaf_types = structure.flatten(result_type)
  firsts, seconds = _leaves(first), _leaves(second)
  if not len(leaf_types) == len(firsts) == len(seconds):
    raise ValueError(f'a merge of {len(firsts)} and {len(seconds)} values '
                     f'where its computation takes {len(leaf_types)}')
  with tf.device('/CPU:0'):  # The worker's kernel, also beside a GPU.
    sums = [tf.raw_ops.AddV2(x=tf.convert_to_tensor(a, t.dtype),
                             y=tf.convert_to_tensor(b, t.dtype)).numpy()
            for t, a, b in zip(leaf_types, firsts, seconds)]
  if not isinstance(result_type, computation_types.StructType):
    return sums[0]  # TFF's mergeable forms merge structs; in case not.
  return type_conversions.type_to_py_container(
      structure.pack_sequence_as(result_type, sums), result_type)


def _leaves(value) -> list:
  try:
    return structure.flatten(structure.from_container(value, recursive=True))
  except TypeError:  # Not a container: one tensor.
    return [value]


class _ThreadedContext(context_base.AsyncContext):
  """An async context whose every call runs in a new daemon thread: a sync
  context's. (Not an executor's pool: its threads are joined at exit, so an
  interrupted run would wait for the running sub-round; and the event loop's
  shared pool has few threads, which would cap how many workers run at
  once.)"""

  def __init__(self, sync_context):
    self._sync_context = sync_context

  async def invoke(self, comp, arg):
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(result, error):
      if not done.cancelled():
        if error is None:
          done.set_result(result)
        else:
          done.set_exception(error)

    def call():
      try:
        result, error = self._sync_context.invoke(comp, arg), None
      except BaseException as e:  # pylint: disable=broad-except
        result, error = None, e
      try:
        loop.call_soon_threadsafe(settle, result, error)
      except RuntimeError:  # The loop is closed: nobody waits any more.
        pass

    threading.Thread(target=call, name='tff-worker-call', daemon=True).start()
    return await done


def threaded_async_context(sync_context) -> context_base.AsyncContext:
  """`sync_context` as an async context for the mergeable context.

  TFF's async contexts talk to their worker with blocking gRPC calls on the
  mergeable context's one event loop: while one worker trains, the loop
  waits on it, so the workers of `--num_workers` / `--worker_addresses` ran
  their sub-rounds one after the other (measured: two workers, one client
  of 0.6 s each, 1.2-1.6 s a call). A sync context has an event loop of its
  own, and each call here runs in a thread, so the workers run at the same
  time (0.6-0.7 s).
  """
  return _ThreadedContext(sync_context)

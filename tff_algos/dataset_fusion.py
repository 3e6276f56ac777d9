"""Builds each client's dataset inside the computation that consumes it.

`contract.compose_by_id` maps a dataset computation `(id, seed) -> dataset`
over the clients and hands the datasets to the algorithm's client
computations. On TFF's C++ runtime a dataset passed from one TF computation
to another is serialized to a graph and rebuilt, and the rebuilt pipeline's
functions are instantiated again, for every client of every round: about 3 ms
a client for the CelebA pipeline, more than the client's training steps of a
small model. TFF 0.87's compiler has no pass that merges a chain of mapped TF
computations into one, so this module does that for the one chain that
matters here: every client-side TF computation that consumes the datasets
(directly, or inside a `federated_zip` with other client values, or picked
out of one) becomes one TF computation that takes the dataset computation's
input instead and builds the dataset in its own graph. The pipeline is the
same seeded graph, so the elements are the same; a dataset consumed twice
(e.g. by the client update and by the cost metrics) is built twice, as the
second pass over a dataset value rebuilt it before.

The fused computations are marked to compile without the graph optimizer's
recomputation heuristics, which break the function optimizer's pass on them
(`pipeline.tff_compiler.without_recomputation`); the rounds are bit-identical
to the unfused ones (tests/test_dataset_fusion.py).
"""

from typing import Union

import tensorflow_federated as tff
from tensorflow_federated.python.common_libs import structure
from tensorflow_federated.python.core.backends.mapreduce import compiler
from tensorflow_federated.python.core.impl.compiler import building_block_factory
from tensorflow_federated.python.core.impl.compiler import building_blocks
from tensorflow_federated.python.core.impl.compiler import intrinsic_defs
from tensorflow_federated.python.core.impl.compiler import transformations
from tensorflow_federated.python.core.impl.compiler import tree_transformations
from tensorflow_federated.python.core.impl.computation import computation_impl
from tensorflow_federated.python.core.impl.context_stack import context_stack_impl
from tensorflow_federated.python.core.impl.types import computation_types

from pipeline import tff_compiler

# Where datasets sit in a client value: a dataset computation (the value at
# this position is its input), or, for a struct, {element index: subtree}.
_DatasetPaths = Union[building_blocks.CompiledComputation, dict]


def _intrinsic_call(value, uri: str) -> bool:
  return (isinstance(value, building_blocks.Call) and
          isinstance(value.function, building_blocks.Intrinsic) and
          value.function.uri == uri)


def _tensorflow(value) -> bool:
  return (isinstance(value, building_blocks.CompiledComputation) and
          value.proto.WhichOneof('computation') == 'tensorflow')


def _with_datasets_built(value: building_blocks.ComputationBuildingBlock,
                         paths: _DatasetPaths
                         ) -> building_blocks.ComputationBuildingBlock:
  """`value` (dataset inputs at `paths`) with the datasets built from them."""
  if isinstance(paths, building_blocks.CompiledComputation):
    return building_blocks.Call(paths, value)
  elements = []
  for index, (name, _) in enumerate(
      structure.iter_elements(value.type_signature)):
    element = building_blocks.Selection(value, index=index)
    if index in paths:
      element = _with_datasets_built(element, paths[index])
    elements.append((name, element))
  return building_blocks.Struct(elements)


def _selection(function) -> bool:
  """Whether `function` is `(x -> x[i])`."""
  return (isinstance(function, building_blocks.Lambda) and
          isinstance(function.result, building_blocks.Selection) and
          isinstance(function.result.source, building_blocks.Reference) and
          function.result.source.name == function.parameter_name)


def _fused_map(function: building_blocks.CompiledComputation,
               argument: building_blocks.Reference, paths: _DatasetPaths,
               parameter_name: str) -> building_blocks.Call:
  member_type = argument.type_signature.member  # pytype: disable=attribute-error
  parameter = building_blocks.Reference(parameter_name, member_type)
  fused = building_blocks.Lambda(
      parameter_name, member_type,
      building_blocks.Call(function, _with_datasets_built(parameter, paths)))
  return building_block_factory.create_federated_map(
      tff_compiler.without_recomputation(
          compiler.compile_local_computation_to_tensorflow(fused)), argument)


def fuse_client_datasets(computation: tff.Computation) -> tff.Computation:
  """`computation` with its client datasets built where they are consumed.

  Returns `computation` itself when there is nothing to fuse.
  """
  lambda_form = transformations.to_call_dominant(
      computation.to_building_block())
  if not (isinstance(lambda_form, building_blocks.Lambda) and
          isinstance(lambda_form.result, building_blocks.Block)):
    return computation
  names = building_block_factory.unique_name_generator(lambda_form)
  # Client values that are, or contain, datasets: local name -> (where the
  # datasets sit, a reference to the same value with dataset inputs there).
  carriers: dict[str, tuple[_DatasetPaths, building_blocks.Reference]] = {}
  new_locals = []
  fused_any = False

  def add_inputs_local(name, paths, value):
    inputs_name = next(names)
    new_locals.append((inputs_name, value))
    carriers[name] = (paths, building_blocks.Reference(
        inputs_name, value.type_signature))

  for name, value in lambda_form.result.locals:
    new_locals.append((name, value))
    if _intrinsic_call(value, intrinsic_defs.FEDERATED_MAP.uri):
      function, argument = value.argument[0], value.argument[1]
      if not isinstance(argument, building_blocks.Reference):
        continue
      carried = carriers.get(argument.name)
      if _tensorflow(function) and carried:
        # A client computation of the datasets: build them inside it.
        new_locals[-1] = (name, _fused_map(function, carried[1], carried[0],
                                           next(names)))
        fused_any = True
      elif _tensorflow(function) and isinstance(
          function.type_signature.result, computation_types.SequenceType):
        carriers[name] = (function, argument)
      elif carried and isinstance(carried[0], dict) and _selection(function):
        # Picking one element of a zip that holds datasets: pick it from the
        # zip of dataset inputs instead.
        index = function.result.as_index()
        selected = building_block_factory.create_federated_getitem_call(
            carried[1], index)
        if index in carried[0]:
          add_inputs_local(name, carried[0][index], selected)
        else:  # Not a dataset: the same value, without the zip of datasets.
          new_locals[-1] = (name, selected)
    elif _intrinsic_call(value, intrinsic_defs.FEDERATED_ZIP_AT_CLIENTS.uri):
      paths = {}
      input_elements = []
      for index, (element_name, element) in enumerate(
          structure.iter_elements(value.argument)):
        carried = (isinstance(element, building_blocks.Reference) and
                   carriers.get(element.name))
        if carried:
          paths[index], element = carried
        input_elements.append((element_name, element))
      if paths:
        add_inputs_local(name, paths,
                         building_block_factory.create_federated_zip(
                             building_blocks.Struct(input_elements)))
  if not fused_any:
    return computation
  fused = building_blocks.Lambda(
      lambda_form.parameter_name, lambda_form.parameter_type,
      building_blocks.Block(new_locals, lambda_form.result.result))
  fused, _ = tree_transformations.remove_unused_block_locals(fused)
  # The original signature keeps its Python containers (to_call_dominant
  # drops them), so callers get the same structures back.
  return computation_impl.ConcreteComputation(
      computation_proto=fused.proto,
      context_stack=context_stack_impl.context_stack,
      annotated_type=computation.type_signature)

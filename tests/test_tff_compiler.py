"""pipeline.tff_compiler: TFF 0.87's compiler, without its two grappler errors.

Computations compile to exactly what TFF's `desugar_and_transform_to_native`
gives, except that client computations that build their own datasets skip
the memory optimizer's recomputation heuristics (which make the function
optimizer fail on them) and computations without outputs skip grappler;
neither logs an error any more.
"""

import pytest
from tensorflow_federated.python.core.backends.native import compiler as tff_native_compiler
from tensorflow_federated.python.core.impl.compiler import building_blocks
from tensorflow_federated.python.core.impl.compiler import tree_analysis

from tff_algos.runtime import tff_compiler
from tasks import base
from tasks import registry as task_registry
from tff_algos import contract
from tff_algos import registry
from tff_algos.config import AlgorithmConfig

import test_native_runtime

FUNCTION_OPTIMIZER_ERROR = 'function_optimizer failed'
NO_FETCH_ERROR = 'Failed to detect the fetch node(s)'


def _tensorflow_computations(computation):
  found = []

  def visit(block):
    if isinstance(block, building_blocks.CompiledComputation):
      found.append(block.proto)

  tree_analysis.visit_postorder(computation.to_building_block(), visit)
  return found


def _process(task, algorithm_name, fuse_datasets):
  algorithm = registry.build_algorithm(algorithm_name, task.model_fn,
                                       AlgorithmConfig())
  return contract.compose_by_id(algorithm, task.client_dataset_computation,
                                task.server_dataset_computation,
                                fuse_datasets=fuse_datasets)


@pytest.mark.parametrize('algorithm_name', ['fedavg', 'scaffold'])
def test_unfused_computations_compile_as_tff_compiles_them(capfd,
                                                           algorithm_name):
  task = test_native_runtime.tiny_task(client_steps=2)
  process = _process(task, algorithm_name, fuse_datasets=False)
  for computation in (process.initialize, process.next):
    capfd.readouterr()
    ours = tff_compiler.compile_for_native_runtime(computation)
    our_log = capfd.readouterr().err
    tffs = tff_native_compiler.desugar_and_transform_to_native(computation)
    tff_log = capfd.readouterr().err
    assert ours.type_signature == tffs.type_signature
    assert (_tensorflow_computations(ours) ==
            _tensorflow_computations(tffs))
    assert 'E tensorflow' not in our_log, our_log
  if algorithm_name == 'fedavg':
    # TFF's pipeline runs grappler on FedAvg's empty client state.
    assert NO_FETCH_ERROR in tff_log


@pytest.mark.time_limit(900)
def test_fused_client_computations_compile_without_errors(capfd):
  # The CelebA-shaped model's fused client update is where TFF's
  # configuration makes the function optimizer fail.
  task = task_registry.build_task('celeba_smile', base.DataConfig(
      client_steps=2, use_synthetic_data=True,
      options=dict(celeba_mode='federated')))
  process = _process(task, 'fedavg', fuse_datasets=True)
  capfd.readouterr()
  tff_native_compiler.desugar_and_transform_to_native(process.next)
  tff_log = capfd.readouterr().err
  tff_compiler.compile_for_native_runtime(process.next)
  our_log = capfd.readouterr().err
  assert FUNCTION_OPTIMIZER_ERROR in tff_log
  assert 'E tensorflow' not in our_log, our_log

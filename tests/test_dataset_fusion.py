"""Client datasets are built inside the computations that consume them.

`contract.compose_by_id` fuses the dataset computation into every client
computation of the datasets (`tff_algos.dataset_fusion`). Checked here: no
algorithm is left with a client computation whose result is a dataset (each
would cost a serialized dataset per client and round), and the fused rounds
are exactly the unfused ones.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_federated.python.core.impl.compiler import building_blocks
from tensorflow_federated.python.core.impl.compiler import intrinsic_defs
from tensorflow_federated.python.core.impl.compiler import transformations
from tensorflow_federated.python.core.impl.types import computation_types

from tasks import base
from tasks import movielens
import fedres_testing
from test_native_runtime import CONFIGS
from test_native_runtime import FEDRES_CONFIGS
from test_native_runtime import run_process_rounds
from test_native_runtime import tiny_task
from tff_algos import contract
from tff_algos import registry
from tff_algos.config import AlgorithmConfig


def _dataset_producing_client_maps(computation) -> int:
  cdf = transformations.to_call_dominant(computation.to_building_block())
  count = 0
  for _, value in cdf.result.locals:
    if (isinstance(value, building_blocks.Call) and
        isinstance(value.function, building_blocks.Intrinsic) and
        value.function.uri == intrinsic_defs.FEDERATED_MAP.uri and
        isinstance(value.argument[0].type_signature.result,
                   computation_types.SequenceType)):
      count += 1
  return count


@pytest.fixture(scope='module')
def tasks():
  fedres_task = fedres_testing.linear_task(
      fedres_testing.client_data(seed=1, sizes=(4, 6, 2, 5)),
      base.DataConfig(client_batch_size=2, client_steps=2))
  return {'tiny': tiny_task(client_steps=2), 'fedres': fedres_task}


def _compose(name, tasks, fuse_datasets):
  if name in FEDRES_CONFIGS:
    task, config = tasks['fedres'], FEDRES_CONFIGS[name]
  else:
    task, config = tasks['tiny'], CONFIGS[name]
  algorithm = registry.build_algorithm(name.split('_option_')[0],
                                       task.model_fn, config, task=task)
  process = contract.compose_by_id(
      algorithm, task.client_dataset_computation,
      task.server_dataset_computation, fuse_datasets=fuse_datasets)
  return algorithm, task, process


@pytest.mark.parametrize('name', list(CONFIGS) + list(FEDRES_CONFIGS))
def test_no_client_dataset_is_passed_between_computations(tasks, name):
  _, _, unfused = _compose(name, tasks, fuse_datasets=False)
  assert _dataset_producing_client_maps(unfused.next) >= 1
  _, _, fused = _compose(name, tasks, fuse_datasets=True)
  assert _dataset_producing_client_maps(fused.next) == 0
  assert fused.next.type_signature == unfused.next.type_signature


def test_a_second_consumer_of_the_datasets_is_fused_too():
  # MovieLens' per-client cost metrics pass over the datasets again.
  task = movielens.build_task(base.DataConfig(
      use_synthetic_data=True, client_steps=2, client_batch_size=4,
      central_steps=2, options=dict(movielens_embedding_dim=4)))
  algorithm = registry.build_algorithm('mixed_pt', task.model_fn,
                                       AlgorithmConfig(
                                           central_steps=2,
                                           central_loss_fn=task.central_loss_fn))
  process = contract.compose_by_id(
      algorithm, task.client_dataset_computation,
      task.server_dataset_computation, task.client_cost_fn)
  assert _dataset_producing_client_maps(process.next) == 0


# Two passes over a client's dataset in one computation, with client states
# (SCAFFOLD Option I: its datasets reach the client update inside a zip with
# the states), and FedResSGD's two passes.
@pytest.mark.parametrize('name', ['scaffold_option_1', 'fedres_sgd'])
def test_fused_rounds_equal_unfused_rounds_exactly(tasks, name):
  algorithm, task, unfused = _compose(name, tasks, fuse_datasets=False)
  _, _, fused = _compose(name, tasks, fuse_datasets=True)
  expected = run_process_rounds(algorithm, task, unfused)
  actual = run_process_rounds(algorithm, task, fused)
  flat_expected = tf.nest.flatten(expected)
  flat_actual = tf.nest.flatten(actual)
  assert len(flat_actual) == len(flat_expected)
  for a, e in zip(flat_actual, flat_expected):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))

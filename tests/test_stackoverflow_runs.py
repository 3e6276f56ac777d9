"""End-to-end runs: stackoverflow_char with every mixed FL algorithm and
FedAvg (in-process driver on the real-format fixtures; one CLI run on
synthetic data with the paper's defaults), stackoverflow_word with FedAvg."""

import csv
import json
import math
import os

import numpy as np
import pytest
import tensorflow as tf
from absl import flags

from binaries import flags_lib
from pipeline import driver
from tasks import base
from tasks import registry as task_registry
from tasks import stackoverflow_char as so_char
from tests import round_testing
from tests import stackoverflow_fixture as fixture
from tff_algos.algorithms import registry as algorithm_registry
import fault_testlib

CENTRAL_STEPS = 2
EVAL_SETS = ('eval', 'eval_stackoverflow', 'eval_wikipedia')


@pytest.fixture(scope='module')
def char_task(tmp_path_factory):
  cache_dir = tmp_path_factory.mktemp('tff_cache')
  fixture.write_stackoverflow_sqlite(cache_dir / so_char.SQLITE_NAME)
  data_dir = tmp_path_factory.mktemp('tfds')
  fixture.write_wikipedia_tfds(str(data_dir))
  return task_registry.build_task('stackoverflow_char', base.DataConfig(
      cache_dir=str(cache_dir), data_dir=str(data_dir), client_batch_size=2,
      client_steps=2, central_batch_size=3, central_steps=CENTRAL_STEPS,
      options={'char_embedding_dim': 4, 'gru_units': 4,
               'max_eval_sequences': 6}))


def _train(task, algorithm_name, root, **settings):
  # K (the central model's steps) is the task's client_steps.
  assert task.data_config.client_steps == CENTRAL_STEPS
  algorithm = algorithm_registry.build(
      algorithm_name, task, round_testing.settings_of(
          algorithm_name, client_learning_rate=0.5,
          central_learning_rate=0.5, federated_weight=0.73,
          central_weight=0.27, **settings))
  result = driver.train(algorithm, task, driver.RunConfig(
      root_output_dir=str(root), experiment_name=algorithm_name,
      total_rounds=1, clients_per_round=2,
      export=algorithm_name == 'fedavg'))
  with open(os.path.join(root, algorithm_name, 'metrics.csv')) as f:
    [row] = list(csv.DictReader(f))
  return result, row


def _assert_trained(task, result, row):
  assert math.isfinite(float(row['train/loss']))
  for eval_set in EVAL_SETS:
    assert 0.0 <= float(row[f'{eval_set}/accuracy']) <= 1.0
    assert math.isfinite(float(row[f'{eval_set}/loss']))
  initial = driver.initial_model_weights(task, 0)
  assert any(not np.allclose(a, b) for a, b in zip(
      initial.trainable, result.model_weights.trainable))


@pytest.mark.parametrize('algorithm_name', ['mixed_pt', 'mixed_1wgt'])
def test_char_task_trains_with_mixed_fl(char_task, tmp_path, algorithm_name):
  result, row = _train(char_task, algorithm_name, tmp_path)
  _assert_trained(char_task, result, row)
  assert math.isfinite(float(row['central/loss']))
  # PT takes K central steps; 1-w GT one central gradient.
  expected_steps = CENTRAL_STEPS if algorithm_name == 'mixed_pt' else 1
  assert float(row['central/num_steps']) == expected_steps


def test_char_task_trains_with_fedavg_and_exports(char_task, tmp_path):
  result, row = _train(char_task, 'fedavg', tmp_path)
  _assert_trained(char_task, result, row)
  assert 'central/loss' not in row
  served = tf.saved_model.load(str(tmp_path / 'fedavg' / 'export'))
  outputs = served.signatures['serving_default'](
      texts=tf.constant(['how do i sort', 'ok']))
  probabilities = outputs['next_char_probabilities'].numpy()
  # bos + the longest text's characters, one distribution each.
  assert probabilities.shape == (2, 14, so_char.CHAR_VOCAB_SIZE)
  np.testing.assert_allclose(probabilities.sum(-1), 1.0, rtol=1e-5)


def test_word_task_trains_with_fedavg(tmp_path):
  task = task_registry.build_task('stackoverflow_word', base.DataConfig(
      use_synthetic_data=True, client_batch_size=2, client_steps=2,
      options={'model_width': 0.02, 'max_eval_sequences': 5}))
  algorithm = algorithm_registry.build(
      'fedavg', task, round_testing.settings_of('fedavg',
                                                client_learning_rate=0.5))
  result = driver.train(algorithm, task, driver.RunConfig(
      root_output_dir=str(tmp_path), experiment_name='word', total_rounds=1,
      clients_per_round=2, export=False))
  metrics = result.last_metrics
  assert math.isfinite(metrics['train/loss'])
  for name in ('accuracy', 'accuracy_without_out_of_vocab',
               'accuracy_without_out_of_vocab_or_end_of_sentence'):
    assert 0.0 <= metrics[f'eval/{name}'] <= 1.0


def test_paper_defaults_for_the_language_model():
  parse = flags.FLAGS
  try:
    for algorithm, central_batch, learning_rate in (
        ('mixed_pt', 800, 2.0), ('mixed_1wgt', 6400, 2.0),
        ('mixed_2wgt', 800, 1.0)):
      parse.unparse_flags()
      parse(['train', '--task=stackoverflow_char', f'--algorithm={algorithm}'])
      applied = flags_lib.apply_task_defaults('stackoverflow_char')
      assert applied == dict(
          clients_per_round=100, client_batch_size=8, client_steps=16,
          client_learning_rate=learning_rate, server_learning_rate=1.0,
          central_batch_size=central_batch,
          central_learning_rate=learning_rate, merge_learning_rate=1.0,
          federated_weight=0.73, central_weight=0.27)
  finally:
    parse.unparse_flags()


def test_cli_runs_two_way_gradient_transfer_on_synthetic_data(tmp_path):
  result = fault_testlib.run_binary(
      'binaries.train', '--task=stackoverflow_char',
      '--algorithm=mixed_2wgt', '--use_synthetic_data',
      '--experiment_name=lm', f'--root_output_dir={tmp_path}',
      '--total_rounds=1', '--char_embedding_dim=4', '--gru_units=4',
      '--client_steps=2', '--client_batch_size=2', '--central_batch_size=4',
      '--clients_per_round=2', '--max_eval_sequences=4')
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / 'lm' / 'hparams.json') as f:
    applied = json.load(f)['task_defaults_applied']
  # The paper's values where the command line is silent (2-w GT: eta=1).
  assert applied['federated_weight'] == 0.73
  assert applied['central_weight'] == 0.27
  assert applied['client_learning_rate'] == 1.0
  assert applied['central_learning_rate'] == 1.0
  assert 'central_batch_size' not in applied
  with open(tmp_path / 'lm' / 'metrics.csv') as f:
    [row] = list(csv.DictReader(f))
  for eval_set in EVAL_SETS:
    assert 0.0 <= float(row[f'{eval_set}/accuracy']) <= 1.0
  assert float(row['central/num_steps']) == 2

"""The driver: resume == uninterrupted, determinism, outputs (in-process)."""

import csv
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from pipeline import driver
from pipeline.errors import UsageError
from tasks import base
from tasks import registry as task_registry
from tff_algos.algorithms import registry as algorithm_registry
from tff_algos.algorithms.baselines import definition as baselines

TIMING_COLUMNS = ('round_seconds', 'eval_seconds')


@pytest.fixture(scope='module')
def task():
  return task_registry.build_task('celeba_smile', base.DataConfig(
      use_synthetic_data=True, client_batch_size=4, client_steps=2,
      options={'celeba_mode': 'federated'}))


@pytest.fixture(scope='module')
def fedavg(task):
  return algorithm_registry.build(
      'fedavg', task, baselines.FedAvgSettings(client_learning_rate=0.05))


def run(algorithm, task, root, name, total_rounds, **kwargs):
  config = driver.RunConfig(root_output_dir=str(root), experiment_name=name,
                            total_rounds=total_rounds, clients_per_round=3,
                            rounds_per_eval=2, **kwargs)
  return driver.train(algorithm, task, config, {'name': name})


def read_metrics(path):
  with open(path) as f:
    rows = list(csv.DictReader(f))
  for row in rows:
    for column in TIMING_COLUMNS:
      row.pop(column, None)
  return rows


def assert_weights_equal(a, b):
  for x, y in zip(a.trainable + a.non_trainable, b.trainable + b.non_trainable):
    np.testing.assert_array_equal(x, y)


def test_resume_equals_uninterrupted_run(fedavg, task, tmp_path):
  run(fedavg, task, tmp_path, 'resumed', 3)
  resumed = run(fedavg, task, tmp_path, 'resumed', 5)
  straight = run(fedavg, task, tmp_path, 'straight', 5)
  assert_weights_equal(resumed.model_weights, straight.model_weights)
  resumed_rows = read_metrics(tmp_path / 'resumed' / 'metrics.csv')
  assert [r['round_num'] for r in resumed_rows] == ['1', '2', '3', '4', '5']
  # Same seed, same flags: identical metrics. The first run's last round (3)
  # was also evaluated, the uninterrupted run's was not: compare the rest.
  straight_rows = read_metrics(tmp_path / 'straight' / 'metrics.csv')
  for resumed_row, straight_row in zip(resumed_rows, straight_rows):
    if resumed_row['round_num'] == '3':
      resumed_row = {k: v for k, v in resumed_row.items()
                     if not k.startswith('eval')}
      straight_row = {k: v for k, v in straight_row.items()
                      if not k.startswith('eval')}
    assert resumed_row == straight_row
  assert all(np.isfinite(float(r['train/loss'])) for r in resumed_rows)
  assert resumed_rows[1]['eval/auc'] and not resumed_rows[0]['eval/auc']


def test_crash_after_logging_resumes_from_checkpoint(fedavg, task, tmp_path):
  run(fedavg, task, tmp_path, 'crash', 3, rounds_per_checkpoint=2)
  expected = read_metrics(tmp_path / 'crash' / 'metrics.csv')
  # Round 3 was logged but, as after a crash, its checkpoint is missing.
  shutil.rmtree(tmp_path / 'crash' / 'checkpoints' / 'round_3')
  run(fedavg, task, tmp_path, 'crash', 3, rounds_per_checkpoint=2)
  assert read_metrics(tmp_path / 'crash' / 'metrics.csv') == expected


def test_a_run_that_fails_before_its_first_row_leaves_no_events_file(
    fedavg, task, tmp_path):
  # TensorBoard's writer made an empty events file at the start of a run
  # whose first round then failed; each re-run that failed made another.
  class RoundFailed(Exception):
    pass

  def fail(round_num):
    raise RoundFailed(round_num)

  config = driver.RunConfig(root_output_dir=str(tmp_path),
                            experiment_name='failed', total_rounds=2,
                            clients_per_round=3)
  with pytest.raises(RoundFailed):
    driver.train(fedavg, task, config, {'name': 'failed'},
                 round_metrics=fail)
  tensorboard = tmp_path / 'failed' / 'tensorboard'
  assert not tensorboard.exists() or not os.listdir(tensorboard)


def test_a_ctrl_c_while_a_round_is_evaluated_checkpoints_the_round_before(
    fedavg, task, tmp_path):
  # A Ctrl-C after round 4's training, before its row, found no round to
  # checkpoint: the run kept round 2's, though round 3's row was written.
  def interrupt_in_round_4(round_num):
    if round_num == 4:
      raise KeyboardInterrupt
    return {}

  config = driver.RunConfig(root_output_dir=str(tmp_path),
                            experiment_name='stopped', total_rounds=6,
                            clients_per_round=3, rounds_per_checkpoint=2)
  with pytest.raises(KeyboardInterrupt):
    driver.train(fedavg, task, config, {'name': 'stopped'},
                 round_metrics=interrupt_in_round_4)
  assert sorted(os.listdir(tmp_path / 'stopped' / 'checkpoints')) == [
      'round_0', 'round_2', 'round_3']
  rows = read_metrics(tmp_path / 'stopped' / 'metrics.csv')
  assert [r['round_num'] for r in rows] == ['1', '2', '3']


def test_other_seed_gives_other_run(fedavg, task, tmp_path):
  a = run(fedavg, task, tmp_path, 'seed0', 1, seed=0)
  b = run(fedavg, task, tmp_path, 'seed1', 1, seed=1)
  assert not np.array_equal(a.model_weights.trainable[0],
                            b.model_weights.trainable[0])


def test_outputs_and_export(fedavg, task, tmp_path):
  result = run(fedavg, task, tmp_path, 'outputs', 1)
  run_dir = tmp_path / 'outputs'
  assert (run_dir / 'hparams.json').is_file()
  events = os.listdir(run_dir / 'tensorboard')
  assert len(events) == 1 and events[0].startswith('events.out.tfevents')
  # Re-running the finished run runs no round: no new (empty) events file.
  run(fedavg, task, tmp_path, 'outputs', 1, export=False)
  assert os.listdir(run_dir / 'tensorboard') == events
  loaded = tf.saved_model.load(str(run_dir / 'export'))
  images = np.random.default_rng(0).uniform(0, 255, [2, 84, 84, 3])
  served = loaded.signatures['serving_default'](
      images=tf.constant(images, tf.float32))
  model = task.keras_model_fn()
  result.model_weights.assign_weights_to(model)
  expected = tf.sigmoid(model(images / 255.0)).numpy()
  np.testing.assert_allclose(served['smiling_probability'].numpy(), expected,
                             rtol=1e-5)


def test_sampling_is_uniform_without_replacement():
  counts = np.zeros(10)
  for round_num in range(1, 2001):
    plan = driver.plan_round(0, round_num, 10, 3)
    assert len(set(plan.client_indices)) == 3
    counts[plan.client_indices] += 1
  np.testing.assert_allclose(counts / 2000, 0.3, atol=0.03)
  assert np.array_equal(driver.plan_round(7, 4, 10, 3).client_indices,
                        driver.plan_round(7, 4, 10, 3).client_indices)


def test_impossible_run_config_is_a_usage_error(fedavg, task, tmp_path):
  with pytest.raises(UsageError, match='clients_per_round'):
    driver.RunConfig(str(tmp_path), 'x', 1, 1000).validate(
        task.num_train_clients)
  with pytest.raises(UsageError, match='total_rounds'):
    driver.RunConfig(str(tmp_path), 'x', 0, 1).validate(10)
  # It said "(allowed: 1..0)".
  with pytest.raises(UsageError, match=r'^the task has no train clients '
                     r'\(its data hold none with training examples\)$'):
    driver.RunConfig(str(tmp_path), 'x', 1, 1).validate(0)


def test_smaller_total_rounds_than_checkpoint_is_refused(fedavg, task,
                                                         tmp_path):
  run(fedavg, task, tmp_path, 'ahead', 2)
  before = (tmp_path / 'ahead' / 'metrics.csv').read_bytes()
  with pytest.raises(UsageError, match='below the round'):
    run(fedavg, task, tmp_path, 'ahead', 1)
  assert (tmp_path / 'ahead' / 'metrics.csv').read_bytes() == before


def test_resume_with_other_results_changing_values(fedavg, task, tmp_path):
  def train(total_rounds, hparams, **kwargs):
    config = driver.RunConfig(root_output_dir=str(tmp_path),
                              experiment_name='flags',
                              total_rounds=total_rounds, clients_per_round=3,
                              **kwargs)
    return driver.train(fedavg, task, config, hparams)

  train(1, {'seed': 0, 'total_rounds': 1})
  run_dir = tmp_path / 'flags'
  files = {name: (run_dir / name).read_bytes()
           for name in ('metrics.csv', 'hparams.json')}
  with pytest.raises(UsageError, match=r'--seed \(run: 0, now: 1\)'):
    train(2, {'seed': 1, 'total_rounds': 2})
  assert {name: (run_dir / name).read_bytes() for name in files} == files
  train(2, {'seed': 1, 'total_rounds': 2}, allow_flag_changes=True)
  with open(run_dir / 'hparams.json') as f:
    hparams = json.load(f)
  assert hparams['seed'] == 1 and hparams['total_rounds'] == 1
  assert hparams['flag_changes'] == [
      {'from_round': 1, 'changes': {'seed': {'run': 0, 'now': 1}}}]
  assert [r['round_num'] for r in read_metrics(run_dir / 'metrics.csv')] == [
      '1', '2']


def test_a_checkpoint_removed_while_read_is_named_so(tmp_path):
  # evaluate reads without the run's lock: a trainer of the same run drops
  # old checkpoints. It was "corrupted or incompatible ... or delete it".
  checkpoints = driver.CheckpointManager(str(tmp_path / 'checkpoints'),
                                         keep=2)
  checkpoints.save(1, [np.ones([2], np.float32)], np.zeros([0], np.int64))
  structure = driver.program_state_structure(
      _StateOnly([np.zeros([2], np.float32)]), 1, 0, False)
  assert checkpoints.load(1, structure)['round_num'] == 1
  with pytest.raises(UsageError, match='round_1 is corrupted or incompatible'):
    checkpoints.load(1, driver.program_state_structure(
        _StateOnly([np.zeros([3], np.float32)]), 1, 0, False))
  # A resume that changed flags (e.g. --algorithm, allowed): an earlier
  # checkpoint holds the run's state too. It advised deleting this one.
  with pytest.raises(UsageError) as error:
    checkpoints.load(1, driver.program_state_structure(
        _StateOnly([np.zeros([3], np.float32)]), 1, 0, False),
                     changed_flags='--algorithm (run: "a", now: "b")')
  assert str(error.value) == (
      f'checkpoint {tmp_path}/checkpoints/round_1 holds a state that the '
      'changed flags cannot continue (a tensor of shape [2] where these flags '
      'make [3]): --algorithm (run: "a", now: "b"); repeat the run\'s '
      'values, or train with the new ones under a new --experiment_name')
  shutil.rmtree(tmp_path / 'checkpoints' / 'round_1')
  with pytest.raises(UsageError,
                     match='round_1 was removed while it was read: the run is '
                     'still training'):
    checkpoints.load(1, structure)


class _StateOnly:
  """What program_state_structure reads of a process."""

  def __init__(self, state):
    self._state = state

  def initialize(self):
    return self._state

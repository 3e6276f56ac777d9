"""FedRes through the driver: personalized evaluation, export, serving, resume.

fedres_logistic (linear softmax, x_g = x_l = x), FedResAvg-II, 4 of 10 clients
per round, client states in the SQLite store.
"""

import csv
import dataclasses
import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

from pipeline import client_store
from pipeline import driver
from pipeline.errors import UsageError
from tasks import base
from tasks import fedres_synthetic
from tff_algos import fedres_export
from tff_algos import registry
from tff_algos.config import AlgorithmConfig

CLIENTS_PER_ROUND = 4
CONFIG = AlgorithmConfig(client_learning_rate=0.1, local_learning_rate=0.2,
                         fedres_option=2)


@pytest.fixture(scope='module')
def task():
  return fedres_synthetic.build_logistic_task(base.DataConfig(
      client_steps=3, client_batch_size=10, seed=0,
      options={'heterogeneity': 1.0}))


@pytest.fixture(scope='module')
def algorithm(task):
  return registry.build_algorithm('fedres_avg', task.model_fn, CONFIG,
                                  task=task)


def _run_config(root, rounds, name='run', export=True):
  return driver.RunConfig(
      root_output_dir=str(root), experiment_name=name, total_rounds=rounds,
      clients_per_round=CLIENTS_PER_ROUND, rounds_per_checkpoint=1,
      client_state_store='sqlite', export=export)


@pytest.fixture(scope='module')
def two_round_run(tmp_path_factory, task, algorithm):
  root = tmp_path_factory.mktemp('fedres_runs')
  result = driver.train(algorithm, task, _run_config(root, 2))
  return root, result


def _sampled_clients(task, rounds):
  ids = task.train_client_ids
  return {ids[i] for r in range(1, rounds + 1) for i in driver.plan_round(
      0, r, len(ids), CLIENTS_PER_ROUND).client_indices}


def _stored_thetas(run_dir):
  store = client_store.ClientStateStore(
      lambda: {'local_model': [np.zeros((10, 2), np.float32)],
               'control': [np.zeros((10, 2), np.float32)]},
      'sqlite', os.path.join(run_dir, 'client_states.sqlite'))
  states = dict(store.items())
  store.close()
  return states


def _softmax(logits):
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _numpy_personal_loss(task, w, thetas):
  """Pooled logistic loss of x W + x Theta_i over every client's test data."""
  losses = []
  for client_id in task.personal_eval_data.client_ids:
    theta = thetas.get(client_id, np.zeros_like(w))
    for x, y in task.personal_eval_data.test_dataset_fn(client_id):
      p = _softmax(x.numpy() @ w + x.numpy() @ theta)
      losses.extend(-np.log(p[np.arange(len(y)), y.numpy()]))
  return float(np.mean(losses))


def test_metrics_have_personalized_beside_global_eval(two_round_run, task):
  root, result = two_round_run
  with open(os.path.join(root, 'run', 'metrics.csv')) as f:
    rows = list(csv.DictReader(f))
  assert [r['round_num'] for r in rows] == ['1', '2']
  last = rows[-1]
  for name in ('train/loss', 'eval/loss', 'eval/accuracy',
               'eval_personalized/loss', 'eval_personalized/accuracy'):
    assert np.isfinite(float(last[name])), name
  seen = _sampled_clients(task, 2)
  assert float(last['eval_personalized/num_clients']) == 10
  assert float(last['eval_personalized/num_unseen_clients']) == 10 - len(seen)
  # The evaluator's number, recomputed in numpy from the run's final w and
  # the stored theta_i (unseen clients: the zero initial theta).
  w = np.asarray(result.model_weights.trainable[0])
  thetas = {c: s['local_model'][0] for c, s in
            _stored_thetas(os.path.join(root, 'run')).items()}
  assert set(thetas) == seen
  np.testing.assert_allclose(float(last['eval_personalized/loss']),
                             _numpy_personal_loss(task, w, thetas), rtol=1e-4)
  np.testing.assert_allclose(float(last['eval/loss']),
                             _numpy_personal_loss(task, w, {}), rtol=1e-4)


def test_export_serves_each_clients_personalized_model(two_round_run, task):
  root, result = two_round_run
  export_dir = os.path.join(root, 'run', 'export')
  assert os.path.isfile(os.path.join(export_dir, 'saved_model.pb'))
  thetas = _stored_thetas(os.path.join(root, 'run'))
  with sqlite3.connect(os.path.join(export_dir,
                                    fedres_export.LOCAL_MODELS_FILE)) as db:
    exported = {r[0] for r in db.execute('SELECT client_id FROM local_models')}
  assert exported == set(thetas)

  w = np.asarray(result.model_weights.trainable[0])
  x = np.random.default_rng(1).normal(size=(5, 10)).astype(np.float32)
  server = fedres_export.PersonalizedServer(export_dir)
  seen = sorted(thetas)[0]
  unseen = (set(task.train_client_ids) - set(thetas)).pop()
  np.testing.assert_allclose(
      server(seen, x)['probabilities'],
      _softmax(x @ w + x @ thetas[seen]['local_model'][0]), rtol=1e-5,
      atol=1e-6)
  np.testing.assert_allclose(server(unseen, x)['probabilities'],
                             _softmax(x @ w), rtol=1e-5, atol=1e-6)
  weights, stored = fedres_export.local_weights_for(export_dir, seen)
  assert stored and weights.shape == (20,)
  assert not fedres_export.local_weights_for(export_dir, unseen)[1]
  with pytest.raises(UsageError, match='not the export of a FedRes run'):
    fedres_export.PersonalizedServer(str(root))


def test_resumed_run_equals_uninterrupted_run(two_round_run, tmp_path, task,
                                              algorithm):
  root, _ = two_round_run
  resumed = driver.train(algorithm, task, _run_config(root, 3))
  straight = driver.train(algorithm, task,
                          _run_config(tmp_path, 3, export=False))
  for a, b in zip(resumed.model_weights.trainable,
                  straight.model_weights.trainable):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(resumed.server_state['control'][0],
                                straight.server_state['control'][0])
  resumed_states = _stored_thetas(os.path.join(root, 'run'))
  straight_states = _stored_thetas(os.path.join(tmp_path, 'run'))
  assert set(resumed_states) == set(straight_states) == _sampled_clients(
      task, 3)
  for client_id, state in straight_states.items():
    for key in ('local_model', 'control'):
      np.testing.assert_array_equal(resumed_states[client_id][key][0],
                                    state[key][0])


def test_memory_store_checkpoints_into_files_and_resumes(tmp_path, task,
                                                          algorithm):
  # The memory store's checkpoints are files beside the driver's (no 2 GB
  # limit); those of dropped checkpoints go with them.
  def memory_config(rounds):
    return dataclasses.replace(
        _run_config(tmp_path, rounds, export=False),
        client_state_store='memory', checkpoints_to_keep=2)

  driver.train(algorithm, task, memory_config(3))
  checkpoint_dir = os.path.join(tmp_path, 'run', 'checkpoints')
  names = os.listdir(checkpoint_dir)
  assert sorted(n for n in names if n.startswith('client_store_')) == [
      'client_store_round_2.sqlite', 'client_store_round_3.sqlite']
  resumed = driver.train(algorithm, task, memory_config(4))
  straight = driver.train(algorithm, task,
                          _run_config(tmp_path / 'straight', 4, export=False))
  for a, b in zip(resumed.model_weights.trainable,
                  straight.model_weights.trainable):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('changes, message', [
    (dict(fedres_option=3), '--fedres_option=3 is unknown'),
    (dict(local_learning_rate=-0.1), '--local_learning_rate'),
    (dict(client_learning_rate=0.0), '--client_learning_rate'),
    (dict(fedres_alpha=0.0), '--fedres_alpha'),
])
def test_bad_hyperparameters_are_usage_errors(task, changes, message):
  with pytest.raises(UsageError, match=message):
    registry.build_algorithm('fedres_avg', task.model_fn,
                             dataclasses.replace(CONFIG, **changes), task=task)


def test_task_without_residual_model_is_a_usage_error(task):
  plain = dataclasses.replace(task, residual_spec=None, name='plain')
  with pytest.raises(UsageError, match='--algorithm=fedres_sgd needs a task'):
    registry.build_algorithm('fedres_sgd', plain.model_fn, CONFIG, task=plain)


def test_heterogeneity_out_of_range_is_a_usage_error():
  with pytest.raises(UsageError, match='--heterogeneity=1.5'):
    fedres_synthetic.build_logistic_task(
        base.DataConfig(options={'heterogeneity': 1.5}))


def test_train_binary_rejects_unknown_fedres_option(tmp_path):
  completed = subprocess.run(
      [sys.executable, '-m', 'binaries.train', '--task=fedres_toy',
       '--algorithm=fedres_avg', '--experiment_name=x', '--fedres_option=3',
       '--clients_per_round=2', f'--root_output_dir={tmp_path}'],
      capture_output=True, text=True, timeout=300,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert completed.returncode == 2
  assert completed.stderr.strip().splitlines()[-1].startswith(
      'error: --fedres_option=3 is unknown; allowed: 1')

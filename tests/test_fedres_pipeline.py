"""FedRes through the driver: personalized evaluation, export, serving, resume.

fedres_logistic (linear softmax, x_g = x_l = x), FedResAvg-II, 4 of 10 clients
per round, client states in the run's client-state files.
"""

import csv
import dataclasses
import os
import shutil
import sqlite3
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from pipeline import driver
from pipeline.errors import UsageError
from tasks import base
from tasks import fedres_synthetic
from tff_algos.algorithms import registry
from tff_algos.algorithms import settings as settings_lib
from tff_algos.algorithms.fedres import definition as fedres
from tff_algos.algorithms.fedres import export as fedres_export
from tff_algos.runtime import client_states
import fault_testlib

CLIENTS_PER_ROUND = 4
SETTINGS = fedres.FedResAvgSettings(client_learning_rate=0.1,
                                    local_learning_rate=0.2, fedres_option=2)


@pytest.fixture(scope='module')
def task():
  return fedres_synthetic.build_logistic_task(base.DataConfig(
      client_steps=3, client_batch_size=10, seed=0,
      options={'heterogeneity': 1.0}))


@pytest.fixture(scope='module')
def algorithm(task):
  return registry.build('fedres_avg', task, SETTINGS)


def _run_config(root, rounds, name='run', export=True):
  return driver.RunConfig(
      root_output_dir=str(root), experiment_name=name, total_rounds=rounds,
      clients_per_round=CLIENTS_PER_ROUND, rounds_per_checkpoint=1,
      export=export)


@pytest.fixture(scope='module')
def two_round_run(tmp_path_factory, task, algorithm):
  root = tmp_path_factory.mktemp('fedres_runs')
  result = driver.train(algorithm, task, _run_config(root, 2))
  return root, result


def _sampled_clients(task, rounds):
  ids = task.train_client_ids
  return {ids[i] for r in range(1, rounds + 1) for i in driver.plan_round(
      0, r, len(ids), CLIENTS_PER_ROUND).client_indices}


def _stored_thetas(algorithm, task, run_dir):
  """Client id -> state, of every client the run's last checkpoint has a
  state for."""
  return dict(driver.committed_client_states(algorithm, task,
                                             run_dir).items())


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


def test_metrics_have_personalized_beside_global_eval(two_round_run, task,
                                                      algorithm):
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
            _stored_thetas(algorithm, task,
                           os.path.join(root, 'run')).items()}
  assert set(thetas) == seen
  np.testing.assert_allclose(float(last['eval_personalized/loss']),
                             _numpy_personal_loss(task, w, thetas), rtol=1e-4)
  np.testing.assert_allclose(float(last['eval/loss']),
                             _numpy_personal_loss(task, w, {}), rtol=1e-4)


def test_export_serves_each_clients_personalized_model(two_round_run, task,
                                                       algorithm):
  root, result = two_round_run
  export_dir = os.path.join(root, 'run', 'export')
  assert os.path.isfile(os.path.join(export_dir, 'saved_model.pb'))
  thetas = _stored_thetas(algorithm, task, os.path.join(root, 'run'))
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


def test_concurrent_calls_take_turns(two_round_run, monkeypatch):
  """The signature writes a client's theta into the local model's variables
  and reads them back: calls from several threads read each other's theta
  (1-2 wrong predictions in 1600 calls from 8 threads). The server's calls
  take turns; here a stand-in signature widens the window between its write
  and its read to make a race certain."""
  root, _ = two_round_run
  server = fedres_export.PersonalizedServer(
      os.path.join(root, 'run', 'export'))
  shared = {}

  def signature(local_weights, **inputs):
    del inputs
    shared['theta'] = local_weights.numpy()
    time.sleep(0.002)
    return {'theta': tf.constant(shared['theta'])}

  server._signature = signature  # pylint: disable=protected-access
  # Each client a theta of its own.
  monkeypatch.setattr(
      fedres_export, 'local_weights_for',
      lambda export_dir, client_id, size: (
          np.full([size], float(client_id), np.float32), True))
  clients = [str(i) for i in range(8)]
  x = np.zeros([1, 10], np.float32)
  expected = {c: np.full([20], float(c), np.float32) for c in clients}
  wrong = []

  def calls(client_id):
    try:
      for _ in range(20):
        if not np.array_equal(server(client_id, x)['theta'],
                              expected[client_id]):
          wrong.append(client_id)
    except Exception as e:  # pylint: disable=broad-except
      wrong.append(e)

  threads = [threading.Thread(target=calls, args=(c,)) for c in clients]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert not wrong


def test_export_serves_what_fit_unseen_evaluation_measured(tmp_path, task):
  # With fedres_fit_unseen the evaluation fits a theta for each client never
  # sampled; the export must serve that theta, not the initial one, so the
  # served predictions give the logged eval_personalized/loss.
  settings = dataclasses.replace(SETTINGS, fedres_fit_unseen=True)
  algorithm = registry.build('fedres_avg', task, settings)
  driver.train(algorithm, task, _run_config(tmp_path, 2))
  with open(os.path.join(tmp_path, 'run', 'metrics.csv')) as f:
    last = list(csv.DictReader(f))[-1]
  assert float(last['eval_personalized/num_unseen_clients']) > 0
  export_dir = os.path.join(tmp_path, 'run', 'export')
  server = fedres_export.PersonalizedServer(export_dir)
  losses = []
  for client_id in task.personal_eval_data.client_ids:
    assert fedres_export.local_weights_for(export_dir, client_id)[1]
    for x, y in task.personal_eval_data.test_dataset_fn(client_id):
      p = server(client_id, x.numpy())['probabilities']
      losses.extend(-np.log(p[np.arange(len(y)), y.numpy()]))
  np.testing.assert_allclose(np.mean(losses),
                             float(last['eval_personalized/loss']), rtol=1e-5)


def test_serving_refuses_damaged_local_models_and_non_finite_inputs(
    two_round_run, tmp_path):
  root, _ = two_round_run
  export_dir = shutil.copytree(os.path.join(root, 'run', 'export'),
                               tmp_path / 'export')
  path = os.path.join(export_dir, fedres_export.LOCAL_MODELS_FILE)
  with sqlite3.connect(path) as db:
    client = db.execute('SELECT client_id FROM local_models').fetchone()[0]
    db.execute("UPDATE local_models SET local_weights = x'00010203' WHERE "
               'client_id = ?', (client,))
  server = fedres_export.PersonalizedServer(str(export_dir))
  x = np.zeros([2, 10], np.float32)
  with pytest.raises(UsageError) as error:
    server(client, x)
  assert str(error.value) == (
      f'{path}: the local model of client {client!r} is 4 bytes, not 20 '
      'float32 values: the file is damaged')
  with sqlite3.connect(path) as db:  # The right size, one bit changed.
    other, blob = db.execute(
        'SELECT client_id, local_weights FROM local_models WHERE client_id '
        '!= ?', (client,)).fetchone()
    changed = bytes([blob[0] ^ 1]) + blob[1:]
    db.execute('UPDATE local_models SET local_weights = ? WHERE client_id = '
               '?', (changed, other))
  with pytest.raises(UsageError) as error:
    server(other, x)
  assert str(error.value) == (
      f'{path}: the local model of client {other!r} does not match its '
      'checksum: the file is damaged (or its rows were changed); export the '
      'run again')
  with sqlite3.connect(path) as db:  # Intact rows, under each other's ids.
    db.execute('UPDATE local_models SET local_weights = ? WHERE client_id = '
               '?', (blob, other))
    rows = db.execute('SELECT client_id, local_weights, sha256 FROM '
                      'local_models WHERE client_id != ? ORDER BY client_id '
                      'LIMIT 2', (client,)).fetchall()
    for (own_id, _, _), (_, blob, checksum) in zip(rows, rows[::-1]):
      db.execute('UPDATE local_models SET local_weights = ?, sha256 = ? '
                 'WHERE client_id = ?', (blob, checksum, own_id))
  for own_id, _, _ in rows:
    with pytest.raises(UsageError) as error:
      server(own_id, x)
    assert 'does not match its checksum' in str(error.value)
  with sqlite3.connect(path) as db:  # As this pipeline wrote it before.
    db.execute('ALTER TABLE local_models DROP COLUMN sha256')
  with pytest.raises(UsageError) as error:
    server(client, x)
  assert str(error.value) == (f'{path} was written before local models had '
                              'checksums; export the run again')
  # An id from argv bytes that are not UTF-8 (a UnicodeEncodeError
  # traceback from sqlite).
  with pytest.raises(UsageError) as error:
    server('\udcff', np.zeros([2, 10], np.float32))
  assert str(error.value) == ("client id '\\udcff' is not UTF-8 text: no "
                              'client has it')
  x[0, 1], x[1, 2] = np.nan, -np.inf
  with pytest.raises(UsageError) as error:
    server.check_inputs(x)
  assert str(error.value) == ('inputs hold 2 non-finite value(s) (NaN or '
                              'inf); predictions need finite inputs')


def test_training_keeps_what_its_export_did_not_write(tmp_path, task,
                                                      algorithm):
  run = tmp_path / 'run'
  (run / 'export').mkdir(parents=True)
  (run / 'export' / 'NOTES.txt').write_text('mine')
  (run / 'export.old').mkdir()  # A user's backup.
  (run / 'export.old' / 'b.txt').write_text('mine')
  with pytest.raises(UsageError) as error:  # Before the first round.
    driver.train(algorithm, task, _run_config(tmp_path, 1))
  assert str(error.value) == (
      f'{run}/export holds NOTES.txt, which is not part of an export of '
      'this pipeline: replacing the export would lose it; move it away')
  assert not os.path.exists(run / 'metrics.csv')  # No round ran.
  assert os.listdir(run / 'export') == ['NOTES.txt']
  (run / 'export' / 'NOTES.txt').unlink()
  driver.train(algorithm, task, _run_config(tmp_path, 1))
  assert os.path.isfile(run / 'export' / 'saved_model.pb')
  assert (run / 'export.old' / 'b.txt').read_text() == 'mine'
  assert not [name for name in os.listdir(run) if 'staging' in name]


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
  resumed_states = _stored_thetas(algorithm, task, os.path.join(root, 'run'))
  straight_states = _stored_thetas(algorithm, task,
                                   os.path.join(tmp_path, 'run'))
  assert set(resumed_states) == set(straight_states) == _sampled_clients(
      task, 3)
  for client_id, state in straight_states.items():
    for key in ('local_model', 'control'):
      np.testing.assert_array_equal(resumed_states[client_id][key][0],
                                    state[key][0])


def _versions_at(task, round_num):
  """Client id -> the round of its newest state after round `round_num`."""
  ids = task.train_client_ids
  versions = {}
  for r in range(1, round_num + 1):
    for i in driver.plan_round(0, r, len(ids),
                               CLIENTS_PER_ROUND).client_indices:
      versions[ids[i]] = r
  return versions


def test_client_states_of_dropped_checkpoints_are_deleted_and_resume(
    tmp_path, task, algorithm):
  # The state files kept are those the kept checkpoints name; those only
  # dropped checkpoints named go with them.
  def config(rounds):
    return dataclasses.replace(_run_config(tmp_path, rounds, export=False),
                               checkpoints_to_keep=2)

  driver.train(algorithm, task, config(4))
  run_dir = os.path.join(tmp_path, 'run')
  assert sorted(driver.CheckpointManager(
      os.path.join(run_dir, 'checkpoints'), keep=0).rounds()) == [3, 4]
  state_dir = os.path.join(run_dir, driver.CLIENT_STATE_DIR)
  stored = {(int(round_dir.split('_')[1]), client_states.client_id_of(name))
            for round_dir in os.listdir(state_dir)
            for name in os.listdir(os.path.join(state_dir, round_dir))}
  named = {(version, client_id) for checkpoint_round in (3, 4)
           for client_id, version in _versions_at(task,
                                                  checkpoint_round).items()}
  assert stored == named
  # Some states were deleted: those of round 1 that round 3 replaced.
  assert named != {(v, c) for r in range(1, 5)
                   for c, v in _versions_at(task, r).items()}
  resumed = driver.train(algorithm, task, config(5))
  straight = driver.train(algorithm, task,
                          _run_config(tmp_path / 'straight', 5, export=False))
  for a, b in zip(resumed.model_weights.trainable,
                  straight.model_weights.trainable):
    np.testing.assert_array_equal(a, b)


def test_a_rerun_deletes_states_a_kill_after_the_last_checkpoint_left(
    tmp_path, task, algorithm):
  # Killed after writing its last checkpoint, before deleting the states
  # only the dropped checkpoints named: the rerun (nothing left to train)
  # deletes them; the states the kept checkpoints name stay.
  config = dataclasses.replace(_run_config(tmp_path, 4, export=False),
                               checkpoints_to_keep=2)
  driver.train(algorithm, task, config)
  state_dir = os.path.join(tmp_path, 'run', driver.CLIENT_STATE_DIR)

  def stored():
    return {os.path.join(round_dir, name)
            for round_dir in os.listdir(state_dir)
            for name in os.listdir(os.path.join(state_dir, round_dir))}

  kept = stored()
  some_state = os.path.join(state_dir, sorted(kept)[0])
  left_behind = [os.path.join('round_1', client_states.file_name(c))
                 for c in task.train_client_ids[:2]]
  os.makedirs(os.path.join(state_dir, 'round_1'), exist_ok=True)
  for name in left_behind:
    assert name not in kept
    shutil.copy(some_state, os.path.join(state_dir, name))
  driver.train(algorithm, task, config)
  assert stored() == kept


def test_a_rerun_drops_a_checkpoint_an_interrupted_save_left(
    tmp_path, task, algorithm):
  # Stopped after writing checkpoint 4 but before the save dropped checkpoint
  # 2 (SIGINT cancels the save's task while its writer thread finishes): the
  # rerun, with no round left, drops it and the states only it named, as an
  # uninterrupted run did (scripts/fault_injection.py --signals=intpg found
  # an extra checkpoint and its client-state files).
  def config(rounds):
    return dataclasses.replace(_run_config(tmp_path, rounds, export=False),
                               checkpoints_to_keep=2)

  run_dir = tmp_path / 'run'
  driver.train(algorithm, task, config(3))
  shutil.copytree(run_dir, tmp_path / 'at_3')
  driver.train(algorithm, task, config(4))

  def stored():
    return sorted(os.path.relpath(os.path.join(root, name), run_dir)
                  for directory in ('checkpoints', driver.CLIENT_STATE_DIR)
                  for root, _, names in os.walk(run_dir / directory)
                  for name in names)

  uninterrupted = stored()
  # What the save of round 4 leaves when stopped before its deletions.
  for name in ('checkpoints/round_2', driver.CLIENT_STATE_DIR):
    shutil.copytree(tmp_path / 'at_3' / name, run_dir / name,
                    dirs_exist_ok=True)
  checkpoints = driver.CheckpointManager(str(run_dir / 'checkpoints'), keep=0)
  assert checkpoints.rounds() == [2, 3, 4]
  driver.train(algorithm, task, config(4))
  assert checkpoints.rounds() == [3, 4]
  assert stored() == uninterrupted


@pytest.mark.parametrize('changes, name, message', [
    (dict(fedres_option=3), 'fedres_option', 'fedres_option=3 is unknown'),
    (dict(local_learning_rate=-0.1), 'local_learning_rate',
     'local_learning_rate must be'),
    (dict(client_learning_rate=0.0), 'client_learning_rate',
     'client_learning_rate must be'),
    (dict(fedres_alpha=0.0), 'fedres_alpha', 'fedres_alpha must be'),
])
def test_bad_hyperparameters_are_usage_errors(changes, name, message):
  # A SettingError names the flag; the binaries print `error: --<message>`.
  with pytest.raises(settings_lib.SettingError, match=message) as raised:
    dataclasses.replace(SETTINGS, **changes)
  assert raised.value.name == name


def test_task_without_residual_model_is_a_usage_error(task):
  plain = dataclasses.replace(task, residual_spec=None, name='plain')
  with pytest.raises(settings_lib.SettingError,
                     match='algorithm=fedres_sgd needs a task') as raised:
    registry.build('fedres_sgd', plain,
                   fedres.FedResSettings(client_learning_rate=0.1))
  assert raised.value.name == 'algorithm'


def test_heterogeneity_out_of_range_is_a_usage_error():
  with pytest.raises(UsageError, match='--heterogeneity=1.5'):
    fedres_synthetic.build_logistic_task(
        base.DataConfig(options={'heterogeneity': 1.5}))


def test_train_binary_rejects_unknown_fedres_option(tmp_path):
  completed = fault_testlib.run_binary(
      'binaries.train', '--task=fedres_toy',
      '--algorithm=fedres_avg', '--experiment_name=x', '--fedres_option=3',
      '--clients_per_round=2', f'--root_output_dir={tmp_path}', timeout=300)
  assert completed.returncode == 2
  assert completed.stderr.strip().splitlines()[-1].startswith(
      'error: --fedres_option=3 is unknown; allowed: 1')

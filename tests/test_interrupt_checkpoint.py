"""A Ctrl-C checkpoints the newest finished round, and the run resumes from it
exactly: SCAFFOLD's server state, control variates and stored c_i equal an
uninterrupted run's, bit for bit."""

import csv
import os

import numpy as np
import pytest
import tensorflow as tf

import scaffold_testlib as lib
from pipeline import driver
from tff_algos.algorithms import registry

ROUNDS = 5
INTERRUPTED_ROUND = 3


def _train(root, name, runtime, interrupt_in=None, monkeypatch=None):
  task = lib.build_linear_task()
  settings = registry.settings_class('scaffold')(
      client_learning_rate=lib.CLIENT_LR, server_learning_rate=lib.SERVER_LR)
  definition = registry.build('scaffold', task, settings)
  config = driver.RunConfig(
      root_output_dir=str(root), experiment_name=name, total_rounds=ROUNDS,
      clients_per_round=lib.CLIENTS_PER_ROUND, rounds_per_eval=ROUNDS,
      rounds_per_checkpoint=100, seed=lib.SEED, export=False, runtime=runtime)
  if interrupt_in is not None:
    compose = driver.compose_process

    def interrupting(*args, **kwargs):
      process = compose(*args, **kwargs)
      next_fn = process.next

      class Interrupting:
        def __getattr__(self, attr):
          return getattr(process, attr)

        def next(self, state, groups, round_num, server_seed):
          result = next_fn(state, groups, round_num, server_seed)
          if round_num == interrupt_in:
            # The round's clients wrote their states; nothing committed them.
            raise KeyboardInterrupt
          return result

      return Interrupting()

    monkeypatch.setattr(driver, 'compose_process', interrupting)
  try:
    result = driver.train(definition, task, config)
  finally:
    if interrupt_in is not None:
      monkeypatch.setattr(driver, 'compose_process', compose)
  states = driver.committed_client_states(definition, task, config.run_dir)
  ids = [str(k) for k in range(lib.NUM_CLIENTS)]
  return result, states.read(ids), config.run_dir


def _rows(run_dir):
  with open(os.path.join(run_dir, 'metrics.csv')) as f:
    return [{k: v for k, v in row.items() if not k.endswith('_seconds')}
            for row in csv.DictReader(f)]


def _assert_resumes_exactly(root, runtime):
  """Re-running 'run' ends as an uninterrupted 'reference' run: metrics
  rows, server state and every client's stored c_i, bit for bit."""
  resumed, resumed_states, run_dir = _train(root, 'run', runtime)
  reference, reference_states, reference_dir = _train(root, 'reference',
                                                      runtime)
  assert _rows(run_dir) == _rows(reference_dir)
  for a, b in zip(tf.nest.flatten((resumed.server_state, resumed_states)),
                  tf.nest.flatten((reference.server_state, reference_states)),
                  strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('runtime', ['native', 'tff'])
def test_ctrl_c_checkpoints_the_last_finished_round(tmp_path, monkeypatch,
                                                    runtime):
  with pytest.raises(KeyboardInterrupt):
    _train(tmp_path, 'run', runtime, INTERRUPTED_ROUND, monkeypatch)
  run_dir = tmp_path / 'run'
  # Only round 0 was due (every 100 rounds); round 2 is the interrupt's.
  assert sorted(os.listdir(run_dir / 'checkpoints')) == ['round_0', 'round_2']
  assert [r['round_num'] for r in _rows(run_dir)] == ['1', '2']
  # Round 3's states are on disk, uncommitted; the resume removes them.
  assert (run_dir / 'client_states' / 'round_3').is_dir()

  _assert_resumes_exactly(tmp_path, runtime)


@pytest.mark.parametrize('runtime', ['native', 'tff'])
def test_ctrl_c_after_a_rounds_commit_checkpoints_the_round_before(
    tmp_path, monkeypatch, runtime):
  # Round 3's commit deleted the states it replaced, so round 2's index
  # named files that were gone: a Ctrl-C from there to round 3's row (e.g.
  # during its evaluation) went back to round 0. They now stay until the
  # row.
  commit = driver.ClientStateKeeper.commit

  def interrupted_commit(self, indices, round_num):
    commit(self, indices, round_num)
    if round_num == INTERRUPTED_ROUND:
      raise KeyboardInterrupt

  monkeypatch.setattr(driver.ClientStateKeeper, 'commit', interrupted_commit)
  with pytest.raises(KeyboardInterrupt):
    _train(tmp_path, 'run', runtime)
  monkeypatch.setattr(driver.ClientStateKeeper, 'commit', commit)
  run_dir = tmp_path / 'run'
  assert sorted(os.listdir(run_dir / 'checkpoints')) == ['round_0', 'round_2']
  assert [r['round_num'] for r in _rows(run_dir)] == ['1', '2']
  _assert_resumes_exactly(tmp_path, runtime)


def test_ctrl_c_while_a_row_is_written_checkpoints_its_round(tmp_path,
                                                             monkeypatch):
  # The binaries' SIGINT handler calls interrupts.interrupt(); inside the
  # row's writes it takes effect once both are written, and the round is
  # then complete.
  from pipeline import interrupts  # pylint: disable=import-outside-toplevel
  run_coroutine = interrupts.run_coroutine
  csv_rows = []

  def interrupted_in_the_third_row(coroutine):
    is_row = 'CSVFileReleaseManager' in coroutine.__qualname__
    result = run_coroutine(coroutine)
    if is_row:
      csv_rows.append(1)
      if len(csv_rows) == INTERRUPTED_ROUND:
        interrupts.interrupt()
    return result

  monkeypatch.setattr(interrupts, 'run_coroutine',
                      interrupted_in_the_third_row)
  # interrupt() marks the process as interrupted; the teardown restores this
  # (False), or every later run in this test process would stop at once.
  monkeypatch.setattr(interrupts, '_requested', interrupts.requested())
  with pytest.raises(KeyboardInterrupt):
    _train(tmp_path, 'run', 'native')
  monkeypatch.setattr(interrupts, 'run_coroutine', run_coroutine)
  interrupts._requested = False  # pylint: disable=protected-access
  run_dir = tmp_path / 'run'
  assert sorted(os.listdir(run_dir / 'checkpoints')) == ['round_0', 'round_3']
  _assert_resumes_exactly(tmp_path, 'native')

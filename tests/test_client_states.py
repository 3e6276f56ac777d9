"""The on-worker client-state store: format, recovery, garbage collection,
and runs that are killed, damaged or resumed from an older checkpoint.

The crash tests train SCAFFOLD (a full-model c_i per client) on digits with
the binary, kill it with SIGKILL while a round is writing its clients' new
states, optionally leave one of those files half written, re-run the same
command, and require metrics.csv and the final weights to equal an
uninterrupted run's exactly.
"""

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import tensorflow as tf

from binaries import app
from pipeline import errors
from pipeline import export as export_lib
from tff_algos.runtime import client_states
import fault_testlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------
# Format, recovery and garbage collection.


def _format(directory, specs=None):
  if specs is None:
    specs = {'a': tf.TensorSpec([2, 3], tf.float32),
             'b': [tf.TensorSpec([4], tf.int64)]}
  return client_states.StateFormat(
      str(directory), specs,
      lambda: tf.nest.map_structure(lambda s: tf.ones(s.shape, s.dtype),
                                    specs))


def test_a_run_resumes_from_its_moved_store_as_the_refusal_advises(
    train_binary, tmp_path):
  # Following the advice (write the run's path into .owner), the re-run was
  # refused again, as a changed flag needing --allow_flag_changes.
  args = _args(tmp_path, 'run')
  first = train_binary(*[a if not a.startswith('--total_rounds=') else
                         '--total_rounds=2' for a in args])
  assert first.returncode == 0, first.stderr[-3000:]
  moved = tmp_path / 'moved'
  (tmp_path / 'run' / 'client_states').rename(moved)
  args = [*args, f'--client_state_dir={moved}']
  refused = train_binary(*args)
  assert refused.returncode == 2, refused.stderr[-3000:]
  assert 'write the run directory\'s path' in refused.stderr
  (moved / '.owner').write_text(os.path.realpath(tmp_path / 'run') + '\n')
  resumed = train_binary(*args)
  assert resumed.returncode == 0, resumed.stderr[-3000:]


@pytest.mark.parametrize('leaf_dtype', [np.int64, np.float32],
                         ids=['mixed_dtypes', 'one_dtype'])
def test_states_round_trip_by_client_id_and_version(tmp_path, leaf_dtype):
  # One dtype: stored as one flat tensor; mixed: as serialized leaves.
  state_format = _format(tmp_path, specs={
      'a': tf.TensorSpec([2, 3], tf.float32),
      'b': [tf.TensorSpec([4], tf.as_dtype(leaf_dtype))]})
  state = {'a': np.arange(6, dtype=np.float32).reshape(2, 3),
           'b': [np.array([1, 2, 3, 4], leaf_dtype)]}

  @tf.function
  def write_then_read(client_id, version):
    with tf.control_dependencies([state_format.write(client_id, version,
                                                     state)]):
      return state_format.read(client_id, version)

  # Any client id, also with characters file names cannot hold.
  for client_id in ('7', 'user/12 3+x', 'ü'):
    read = write_then_read(tf.constant(client_id), tf.constant(5, tf.int64))
    np.testing.assert_array_equal(read['a'], state['a'])
    np.testing.assert_array_equal(read['b'][0], state['b'][0])
    assert read['b'][0].dtype == leaf_dtype
    assert os.path.getsize(state_format.file_path(client_id, 5)) == (
        client_states.serialized_size(state_format.specs))
    assert os.path.isfile(state_format.file_path(client_id, 5))
    np.testing.assert_array_equal(state_format.load(client_id, 5)['a'],
                                  state['a'])
  assert sorted(os.listdir(tmp_path)) == ['round_5']
  # Version -1: the initializer's state, no file read.
  initial = state_format.read(tf.constant('never'), tf.constant(-1, tf.int64))
  np.testing.assert_array_equal(initial['a'], np.ones([2, 3]))
  assert client_states.client_id_of(client_states.file_name('user/12 3+x')
                                    ) == 'user/12 3+x'


def test_an_empty_state_is_stored_too(tmp_path):
  state_format = _format(tmp_path, specs={'control_variate': []})
  state_format.write(tf.constant('1'), tf.constant(2, tf.int64),
                     {'control_variate': []})
  assert state_format.load('1', 2) == {'control_variate': []}
  assert os.path.getsize(state_format.file_path('1', 2)) == (
      client_states.serialized_size(state_format.specs))


@pytest.mark.parametrize('dtypes,flat', [
    ((np.float32, np.float32), True), ((np.float64, np.float64), True),
    ((np.float32, np.int64), False), ((np.float16, np.float16), False)],
    ids=['float32', 'float64', 'mixed_dtypes', 'float16'])
def test_a_state_with_any_one_value_changed_is_an_error_naming_its_file(
    tmp_path, dtypes, flat):
  state_format = _format(tmp_path, specs={
      'a': tf.TensorSpec([2, 3], tf.as_dtype(dtypes[0])),
      'b': [tf.TensorSpec([4], tf.as_dtype(dtypes[1]))]})
  state = {'a': np.linspace(-1, 1, 6).astype(dtypes[0]).reshape(2, 3),
           'b': [np.arange(4).astype(dtypes[1])]}
  state_format.write(tf.constant('c'), tf.constant(3, tf.int64), state)
  path = state_format.file_path('c', 3)
  intact = open(path, 'rb').read()
  header = client_states.file_header(state_format.specs)
  np.testing.assert_array_equal(state_format.load('c', 3)['a'], state['a'])

  @tf.function(autograph=False)
  def read():
    return state_format.read(tf.constant('c'), tf.constant(3, tf.int64))

  # Every byte after the fixed header: a value or the checksum (one flat
  # tensor); with mixed dtypes also the framing of the serialized leaves.
  found = 0
  for position in range(len(header), len(intact)):
    damaged = bytearray(intact)
    damaged[position] ^= 0x10
    with open(path, 'wb') as f:
      f.write(damaged)
    for load in (lambda: state_format.load('c', 3), read):
      with pytest.raises((tf.errors.InvalidArgumentError,
                          tf.errors.DataLossError)) as raised:
        load()
      if flat or 'assertion failed' in str(raised.value):
        assert (f'[{errors.DAMAGED_CLIENT_STATE}] [{path}]'
                in str(raised.value))
        assert app.bad_data_message(raised.value).startswith(
            f'{path} is damaged, or another client\'s or round\'s state: '
            'its values do not match its checksum')
        found += 1
  # The leaves' own bytes are the most of a file, framing or not.
  assert found > (len(intact) - len(header))


@pytest.mark.parametrize('dtypes', [(np.float32, np.float32),
                                    (np.float32, np.int64)],
                         ids=['flat', 'mixed_dtypes'])
def test_another_clients_or_rounds_state_in_a_file_is_an_error(tmp_path,
                                                               dtypes):
  """A valid state copied over another file passes every size and header
  check; its checksum, keyed by client and round, does not match."""
  state_format = _format(tmp_path, specs={
      'a': tf.TensorSpec([2, 3], tf.as_dtype(dtypes[0])),
      'b': [tf.TensorSpec([4], tf.as_dtype(dtypes[1]))]})

  def write(client_id, version, fill):
    state_format.write(tf.constant(client_id), tf.constant(version, tf.int64),
                       {'a': np.full([2, 3], fill, dtypes[0]),
                        'b': [np.full([4], fill, dtypes[1])]})
    return state_format.file_path(client_id, version)

  target = write('a', 2, 1)
  for source in (write('b', 2, 2), write('a', 1, 3)):
    with open(source, 'rb') as f, open(target, 'wb') as out:
      out.write(f.read())
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
      state_format.load('a', 2)
    assert f'[{errors.DAMAGED_CLIENT_STATE}] [{target}]' in str(raised.value)
  # The file's own state, written again, reads back.
  write('a', 2, 1)
  np.testing.assert_array_equal(state_format.load('a', 2)['a'],
                                np.ones([2, 3]))


def _write(state_format, client_id, version):
  state_format.write(tf.constant(client_id), tf.constant(version, tf.int64),
                     {'a': np.full([2, 3], version, np.float32),
                      'b': [np.zeros([4], np.int64)]})


def test_recovery_removes_uncommitted_rounds_and_gc_keeps_checkpoints(
    tmp_path):
  state_format = _format(tmp_path)
  ids = ('0', '1', '2')
  for version, clients in ((1, ('0', '1')), (2, ('0',)), (3, ('1', '2')),
                           (4, ('0',))):
    for client_id in clients:
      _write(state_format, client_id, version)
  # Checkpoints at rounds 2 and 3; round 4 never committed.
  at_2 = client_states.StateIndex(ids, np.array([2, 1, -1]))
  at_3 = client_states.StateIndex(ids, np.array([2, 3, 3]))
  assert client_states.recover(str(tmp_path), 3) == [4]
  assert not os.path.exists(tmp_path / 'round_4')
  # Only what no kept checkpoint names goes: client 0's version 1.
  assert client_states.collect_garbage(str(tmp_path), [at_2, at_3], 3) == 1
  assert sorted(os.listdir(tmp_path / 'round_1')) == [
      client_states.file_name('1')]
  for index in (at_2, at_3):
    assert not client_states.missing_files(
        state_format, index,
        client_states.serialized_size(state_format.specs))
  # A missing or truncated file of a checkpoint is found.
  os.remove(state_format.file_path('2', 3))
  path = state_format.file_path('1', 3)
  with open(path, 'r+b') as f:
    f.truncate(10)
  assert sorted(client_states.missing_files(
      state_format, at_3,
      client_states.serialized_size(state_format.specs))) == sorted(
          [state_format.file_path('2', 3), path])


def test_files_of_the_user_in_a_round_are_found_and_never_deleted(tmp_path):
  """Both clean-ups deleted every file of a round directory they emptied,
  and a resume found only directories there to refuse."""
  state_format = _format(tmp_path)
  for version in (1, 2, 3):
    _write(state_format, '0', version)
  mine = {f'round_{r}/{name}': name for r, name in (
      (1, 'notes.txt'), (3, 'notes.txt'),
      # Named like a state, but not a name the store gives one.
      (1, 'MA==.state'), (3, 'not base64!.state'))}
  for relative, name in mine.items():
    (tmp_path / relative).write_text(name)
  assert client_states.foreign_entries(str(tmp_path)) == sorted(
      str(tmp_path / relative) for relative in mine)
  # Round 3 after the checkpoint; round 1 named by no kept checkpoint.
  assert client_states.recover(str(tmp_path), 2) == [3]
  at_2 = client_states.StateIndex(('0',), np.array([2]))
  assert client_states.collect_garbage(str(tmp_path), [at_2], 2) == 1
  assert sorted(str(p.relative_to(tmp_path))
                for p in tmp_path.glob('round_*/*')) == sorted(
                    [*mine, f'round_2/{client_states.file_name("0")}'])
  for relative, name in mine.items():
    assert (tmp_path / relative).read_text() == name


def test_a_replaced_state_goes_at_commit_unless_a_kept_checkpoint_names_it(
    tmp_path):
  state_format = _format(tmp_path)
  for client_id, version in (('0', 1), ('1', 1), ('2', 2), ('3', 2)):
    _write(state_format, client_id, version)
  # Round 3 replaced clients 0..3's versions 1, 1, 2, -1; a kept checkpoint
  # names client 1's version 1 and another client 3's version 2 (which is
  # not what it replaced).
  kept = [np.array([-1, 1, -1, -1]), np.array([-1, -1, -1, 2])]
  deleted = client_states.delete_superseded(
      state_format, ['0', '1', '2', '3'], np.array([1, 1, 2, -1]), kept)
  assert deleted == 2
  assert not os.path.exists(state_format.file_path('0', 1))
  assert not os.path.exists(state_format.file_path('2', 2))
  assert os.path.exists(state_format.file_path('1', 1))
  assert os.path.exists(state_format.file_path('3', 2))
  # A round left empty goes with its last state.
  _write(state_format, '4', 5)
  assert client_states.delete_superseded(
      state_format, ['4'], np.array([5]), []) == 1
  assert sorted(os.listdir(tmp_path)) == ['round_1', 'round_2']
  # Already gone: nothing to do, no error.
  assert client_states.delete_superseded(
      state_format, ['0'], np.array([1]), []) == 0


# ---------------------------------------------------------------------------
# Runs of the binary: kills, damage, older checkpoints.

ROUNDS = 6
TRAIN = ['--task=digits', '--algorithm=scaffold', '--num_clients=40',
         '--clients_per_round=30', '--client_steps=25',
         '--client_batch_size=16', '--client_learning_rate=0.05',
         f'--total_rounds={ROUNDS}', '--rounds_per_checkpoint=2',
         '--rounds_per_eval=3', '--runtime=native', '--seed=4']


def _args(root, name):
  return [f'--root_output_dir={root}', f'--experiment_name={name}', *TRAIN]


def _command(root, name):
  return [sys.executable, '-m', 'binaries.train', *_args(root, name)]


# The runs that are not killed: each a process of its own, forked from a
# server that imported binaries.train once (see preloaded_binary).
train_binary = fault_testlib.preloaded_runs('binaries.train')


def _train(train_binary, root, name):
  done = train_binary(*_args(root, name))
  assert done.returncode == 0, done.stderr[-3000:]
  return done


def _results(run_dir):
  with open(os.path.join(run_dir, 'metrics.csv')) as f:
    rows = [{k: v for k, v in row.items() if not k.endswith('_seconds')}
            for row in csv.DictReader(f)]
  weights = export_lib.load_model_weights(os.path.join(run_dir, 'export'))
  return rows, [np.asarray(w) for w in weights.trainable]


@pytest.fixture(scope='module')
def uninterrupted_run(train_binary, tmp_path_factory):
  """The directory of one uninterrupted run of TRAIN (never modified)."""
  root = tmp_path_factory.mktemp('uninterrupted')
  _train(train_binary, root, 'run')
  return root / 'run'


@pytest.fixture(scope='module')
def uninterrupted(uninterrupted_run):
  return _results(uninterrupted_run)


def _copy_of_finished_run(uninterrupted_run, root):
  """What training TRAIN in `root` leaves (the same command, deterministic),
  without running it again: a copy of the uninterrupted run."""
  shutil.copytree(uninterrupted_run, root / 'run', symlinks=True)


def _kill_while_writing_a_round(root, name):
  """Starts the run; SIGKILLs it once a round after the first checkpoint
  has written some, not all, of its clients' states. Returns that round."""
  states = root / name / 'client_states'
  process = subprocess.Popen(_command(root, name), cwd=ROOT,
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL,
                             start_new_session=True)
  try:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
      for round_num in (3, 5):
        path = states / f'round_{round_num}'
        written = len(os.listdir(path)) if path.is_dir() else 0
        if 0 < written < 30:
          os.killpg(process.pid, signal.SIGKILL)
          process.wait()
          return round_num
      time.sleep(0.0005)
  finally:
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
      process.wait()
  pytest.fail('the run never was caught writing a round')


@pytest.mark.parametrize('damage', [False, True],
                         ids=['killed', 'killed_half_written'])
def test_killed_mid_round_resumes_exactly(train_binary, tmp_path,
                                          uninterrupted, damage):
  round_num = _kill_while_writing_a_round(tmp_path, 'run')
  round_dir = tmp_path / 'run' / 'client_states' / f'round_{round_num}'
  files = sorted(round_dir.iterdir())
  assert files  # Some clients of the round had written their state.
  if damage:
    with open(files[0], 'r+b') as f:
      f.truncate(os.path.getsize(files[0]) // 2)
  done = _train(train_binary, tmp_path, 'run')
  assert 'uncommitted' in done.stderr  # The resume says what it removed.
  rows, weights = _results(tmp_path / 'run')
  expected_rows, expected_weights = uninterrupted
  assert rows == expected_rows
  for got, want in zip(weights, expected_weights, strict=True):
    np.testing.assert_array_equal(got, want)


def test_resume_from_an_older_checkpoint_is_exact(train_binary, tmp_path,
                                                  uninterrupted,
                                                  uninterrupted_run):
  # As the error message for a damaged checkpoint advises: delete the newest
  # checkpoint and resume from the one before it.
  _copy_of_finished_run(uninterrupted_run, tmp_path)
  checkpoints = tmp_path / 'run' / 'checkpoints'
  assert (checkpoints / f'round_{ROUNDS}').is_dir()
  for name in os.listdir(checkpoints):
    if name == f'round_{ROUNDS}':
      subprocess.run(['rm', '-r', str(checkpoints / name)], check=True)
  done = _train(train_binary, tmp_path, 'run')
  assert done.returncode == 0
  # The resume ran the last rounds again (it wrote their checkpoint).
  assert (checkpoints / f'round_{ROUNDS}').is_dir()
  rows, weights = _results(tmp_path / 'run')
  expected_rows, expected_weights = uninterrupted
  assert rows == expected_rows
  for got, want in zip(weights, expected_weights, strict=True):
    np.testing.assert_array_equal(got, want)


def test_missing_or_overwritten_client_states_are_one_clear_error(
    train_binary, tmp_path, uninterrupted_run):
  _copy_of_finished_run(uninterrupted_run, tmp_path)
  metrics_before = (tmp_path / 'run' / 'metrics.csv').read_bytes()
  args = _args(tmp_path, 'run')
  args[args.index(f'--total_rounds={ROUNDS}')] = f'--total_rounds={ROUNDS + 1}'

  def resume_fails(damaged: str, says: str = 'missing or damaged'):
    done = train_binary(*args)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [l for l in done.stderr.splitlines() if l.startswith('error:')]
    assert len(errors) == 1 and says in errors[0], errors
    assert damaged in errors[0]
    assert 'Traceback' not in done.stderr
    assert (tmp_path / 'run' / 'metrics.csv').read_bytes() == metrics_before

  # A state file overwritten with other bytes of its size.
  store = tmp_path / 'run' / 'client_states'
  last_round = sorted(store.iterdir())[-1]
  damaged = sorted(last_round.iterdir())[0]
  intact = damaged.read_bytes()
  damaged.write_bytes(np.random.default_rng(0).bytes(len(intact)))
  resume_fails(damaged.name)
  damaged.write_bytes(intact)
  # Every state file holding another client's or round's state (all of
  # them valid, of the right size and header): found when a client reads
  # its state, as the first resumed round starts.
  files = sorted(store.glob('round_*/*.state'))
  contents = [path.read_bytes() for path in files]
  assert len(set(contents)) == len(files) > 1
  for path, content in zip(files, contents[1:] + contents[:1]):
    path.write_bytes(content)
  resume_fails(f'{store}/round_', says=' is damaged, or another client\'s or '
               'round\'s state: its values do not match its checksum')
  for path, content in zip(files, contents):
    path.write_bytes(content)
  # One value changed in every state file (their size and header intact):
  # found as above.
  for path in files:
    values = bytearray(path.read_bytes())
    values[len(values) // 2] ^= 1
    path.write_bytes(values)
  resume_fails(f'{store}/round_', says=' is damaged, or another client\'s or '
               'round\'s state: its values do not match its checksum')
  # The whole store gone.
  subprocess.run(['rm', '-r', str(store)], check=True)
  resume_fails('client_states')


def test_a_resume_refused_for_a_moved_store_makes_no_new_store(
    train_binary, tmp_path):
  """The store directory (--client_state_dir outside the run) was marked as
  the run's before its files were checked: a refused resume left an empty
  store with its mark, and the user's restored store went inside it."""
  store, moved = tmp_path / 'store', tmp_path / 'moved'
  args = [*_args(tmp_path, 'run'), f'--client_state_dir={store}']
  first = train_binary(*[a if not a.startswith('--total_rounds=') else
                         '--total_rounds=2' for a in args])
  assert first.returncode == 0, first.stderr[-3000:]
  store.rename(moved)
  resumed = train_binary(*args)
  assert resumed.returncode == 2, resumed.stderr[-3000:]
  assert 'missing or damaged' in resumed.stderr
  assert not store.exists()
  moved.rename(store)  # Put back, it resumes.
  resumed = train_binary(*args)
  assert resumed.returncode == 0, resumed.stderr[-3000:]


@pytest.mark.parametrize('leaf_dtype', [np.int64, np.float32],
                         ids=['mixed_dtypes', 'one_dtype'])
def test_overwritten_or_truncated_state_files_are_found(tmp_path,
                                                        leaf_dtype):
  state_format = _format(tmp_path, specs={
      'a': tf.TensorSpec([2, 3], tf.float32),
      'b': [tf.TensorSpec([4], tf.as_dtype(leaf_dtype))]})
  index = client_states.StateIndex(['x', 'y', 'z'])
  for client_id in ('x', 'y', 'z'):
    state_format.write(tf.constant(client_id), tf.constant(1, tf.int64),
                       {'a': np.full([2, 3], -3.5, np.float32),
                        'b': [np.arange(4).astype(leaf_dtype)]})
  index.commit([0, 1, 2], 1)
  size = client_states.serialized_size(state_format.specs)
  header = client_states.file_header(state_format.specs)
  assert 0 < len(header) < size
  assert client_states.missing_files(state_format, index, size, header) == []
  overwritten = state_format.file_path('x', 1)
  with open(overwritten, 'wb') as f:
    f.write(np.random.default_rng(1).bytes(size))
  truncated = state_format.file_path('y', 1)
  os.truncate(truncated, size - 1)
  assert client_states.missing_files(state_format, index, size, header) == [
      overwritten, truncated]


@pytest.mark.parametrize('specs', [[], [tf.TensorSpec([0], tf.float32)]],
                         ids=['no_values', 'zero_size'])
def test_states_without_values_pass_the_resume_check(tmp_path, specs):
  # Such a state is its checksum alone, keyed by its name: the header held
  # the checksum of the key '', so every state failed and FedPVR with
  # --pvr_last_layers=0 could not resume ("missing or damaged").
  state_format = _format(tmp_path, specs=specs)
  index = client_states.StateIndex(['x', 'y'])
  values = tf.nest.map_structure(lambda s: np.zeros(s.shape, np.float32),
                                 specs)
  for client_id in ('x', 'y'):
    state_format.write(tf.constant(client_id), tf.constant(3, tf.int64),
                       values)
  index.commit([0, 1], 3)
  size = client_states.serialized_size(specs)
  header = client_states.file_header(specs)
  # The checksum (4 or 8 bytes) is not part of it.
  assert len(header) <= size - 4
  assert client_states.missing_files(state_format, index, size, header) == []
  tf.nest.map_structure(np.testing.assert_array_equal,
                        state_format.load('y', 3), values)


def test_a_store_in_use_by_another_run_is_refused(train_binary, tmp_path):
  """Two new runs on one new --client_state_dir, started at once, both
  passed the store's ownership check (made before any lock) and wrote each
  other's states: a run holds the store's lock, and checks its owner again
  under it."""
  import fcntl  # pylint: disable=g-import-not-at-top
  from pipeline import driver  # pylint: disable=g-import-not-at-top
  store = tmp_path / 'store'
  store.mkdir()
  held = os.open(store / driver.STORE_LOCK_FILE, os.O_WRONLY | os.O_CREAT)
  try:
    fcntl.flock(held, fcntl.LOCK_EX)  # The first run, still starting.
    refused = train_binary(*_args(tmp_path, 'second'),
                           f'--client_state_dir={store}')
  finally:
    os.close(held)
  assert refused.returncode == 2, refused.stderr[-3000:]
  assert refused.stderr.strip().splitlines() == [
      f'error: {store} is in use by another process (it holds '
      f'{store / driver.STORE_LOCK_FILE}); wait for it to finish, or give '
      'each run a store of its own']
  assert sorted(os.listdir(store)) == [driver.STORE_LOCK_FILE]
  assert not (tmp_path / 'second').exists()

  # The first run marked the store after the second's unlocked check: the
  # check under the lock refuses it.
  (store / driver.STORE_OWNER_FILE).write_text(f'{tmp_path / "first"}\n')
  config = driver.RunConfig(
      root_output_dir=str(tmp_path), experiment_name='second', total_rounds=1,
      clients_per_round=1, client_state_dir=str(store))
  stateful = types.SimpleNamespace(has_client_state=True)
  with pytest.raises(errors.UsageError, match='is the store of the run '):
    with driver._store_locked(stateful, config):
      pass

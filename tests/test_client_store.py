"""Client-state store: lazy init, nested round trips, atomicity, rollback."""

import collections

import numpy as np
import pytest

from pipeline import client_store


def initial_state():
  return collections.OrderedDict(
      c=[np.zeros([2, 3], np.float32), np.zeros([3], np.float32)],
      meta=collections.OrderedDict(steps=np.int64(0), flag=np.bool_(False)))


def state_with(value: float):
  state = initial_state()
  state['c'] = [np.full([2, 3], value, np.float32),
                np.arange(3, dtype=np.float32) * value]
  state['meta']['steps'] = np.int64(value)
  return state


def assert_states_equal(actual, expected):
  np.testing.assert_array_equal(actual['c'][0], expected['c'][0])
  np.testing.assert_array_equal(actual['c'][1], expected['c'][1])
  assert actual['meta']['steps'] == expected['meta']['steps']
  assert actual['c'][0].dtype == expected['c'][0].dtype
  assert list(actual.keys()) == list(expected.keys())


@pytest.fixture(params=client_store.BACKENDS)
def store(request, tmp_path):
  store = client_store.open_store(initial_state, request.param, str(tmp_path))
  yield store
  store.close()


def test_unseen_clients_get_the_initial_state_lazily(store):
  [state] = store.read(['never_seen'])
  assert_states_equal(state, initial_state())
  assert store.num_clients() == 0


def test_nested_structures_round_trip(store):
  store.write(1, ['a', 'b'], [state_with(1.5), state_with(-2.0)])
  a, b, c = store.read(['a', 'b', 'c'])
  assert_states_equal(a, state_with(1.5))
  assert_states_equal(b, state_with(-2.0))
  assert_states_equal(c, initial_state())
  assert store.num_clients() == 2


def test_newest_round_wins(store):
  store.write(1, ['a'], [state_with(1.0)])
  store.write(2, ['a'], [state_with(2.0)])
  assert_states_equal(store.read(['a'])[0], state_with(2.0))


def test_failure_mid_round_leaves_previous_round_intact(store):
  store.write(1, ['a', 'b'], [state_with(1.0), state_with(1.0)])

  def failing_states():
    yield state_with(2.0)  # 'a' is written inside the transaction ...
    raise RuntimeError('client crashed')  # ... then the round fails.

  with pytest.raises(RuntimeError, match='client crashed'):
    store.write(2, ['a', 'b'], failing_states())
  a, b = store.read(['a', 'b'])
  assert_states_equal(a, state_with(1.0))
  assert_states_equal(b, state_with(1.0))


def test_mismatched_ids_and_states_write_nothing(store):
  with pytest.raises(ValueError):
    store.write(1, ['a', 'b'], [state_with(1.0)])
  assert store.num_clients() == 0


def test_restore_rolls_back_to_checkpoint(store, tmp_path):
  store.write(1, ['a'], [state_with(1.0)])
  saved = store.checkpoint(1)
  store.write(2, ['a', 'b'], [state_with(2.0), state_with(2.0)])
  store.restore(1, saved)
  a, b = store.read(['a', 'b'])
  assert_states_equal(a, state_with(1.0))
  assert_states_equal(b, initial_state())


def test_checkpoint_survives_a_new_process(tmp_path):
  # A resumed run opens a fresh store and restores the checkpoint into it.
  for backend in client_store.BACKENDS:
    run_dir = tmp_path / backend
    run_dir.mkdir()
    first = client_store.open_store(initial_state, backend, str(run_dir))
    first.write(1, ['a'], [state_with(1.0)])
    first.write(2, ['a'], [state_with(2.0)])
    saved = first.checkpoint(2)
    first.write(3, ['a'], [state_with(3.0)])  # after the checkpoint: lost
    first.close()
    second = client_store.open_store(initial_state, backend, str(run_dir))
    second.restore(2, saved)
    assert_states_equal(second.read(['a'])[0], state_with(2.0))
    second.close()


def test_memory_checkpoint_into_a_directory_is_a_file(tmp_path):
  # The driver's path: the in-memory database is copied into a file (no
  # 2 GB limit, unlike Connection.serialize); a fresh store restores it.
  first = client_store.open_store(initial_state, 'memory', str(tmp_path))
  first.write(1, ['a'], [state_with(1.0)])
  first.write(2, ['a', 'b'], [state_with(2.0), state_with(2.0)])
  saved = first.checkpoint(2, str(tmp_path))
  assert saved == b'file:client_store_round_2.sqlite'
  assert client_store.checkpoint_file_round(
      'client_store_round_2.sqlite') == 2
  first.write(3, ['a'], [state_with(3.0)])  # after the checkpoint: lost
  first.close()
  second = client_store.open_store(initial_state, 'memory', str(tmp_path))
  second.write(3, ['c'], [state_with(3.0)])  # replaced by the restore
  second.restore(2, saved, str(tmp_path))
  a, b, c = second.read(['a', 'b', 'c'])
  assert_states_equal(a, state_with(2.0))
  assert_states_equal(b, state_with(2.0))
  assert_states_equal(c, initial_state())
  (tmp_path / 'client_store_round_2.sqlite').unlink()
  with pytest.raises(client_store.UsageError, match='missing'):
    second.restore(2, saved, str(tmp_path))
  second.close()


def test_checkpoint_prunes_unreachable_versions(tmp_path):
  store = client_store.open_store(initial_state, 'sqlite', str(tmp_path))
  for round_num in range(1, 6):
    store.write(round_num, ['a'], [state_with(round_num)])
  store.checkpoint(5)
  rows = store._connection.execute(  # pylint: disable=protected-access
      'SELECT COUNT(*) FROM client_states').fetchone()[0]
  assert rows == 1
  store.close()


def test_corrupted_blob_is_an_error():
  with pytest.raises(ValueError):
    client_store.deserialize_state(
        client_store.serialize_state(state_with(1.0)) + b'junk',
        initial_state())


def test_unknown_backend_is_a_usage_error(tmp_path):
  with pytest.raises(client_store.UsageError, match='client_state_store'):
    client_store.ClientStateStore(initial_state, 'redis', str(tmp_path / 'x'))

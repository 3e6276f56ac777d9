"""Run-directory guarantees, in-process: resume checks, trimming, the lock,
names, export targets, private temp directories."""

import errno
import json
import os
import subprocess
import sys
import time

import pytest
import tensorflow as tf

import fault_testlib as lib
from pipeline import export as export_lib
from pipeline import private_temp
from pipeline import run_directory
from pipeline import run_logs
from pipeline.errors import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = 'round_num,train/loss,round_seconds\n'


def rows(*rounds):
  return ''.join(f'{r},0.{r},1.5\n' for r in rounds)


# -- hparams -----------------------------------------------------------------

STORED = {'seed': 0, 'client_learning_rate': 0.01, 'total_rounds': 5,
          'num_workers': 1, 'task_defaults_applied': {'a': 1}}


def write_run(run_dir, hparams=STORED, metrics=HEADER + rows(1, 2)):
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, 'hparams.json'), 'w') as f:
    json.dump(hparams, f)
  with open(os.path.join(run_dir, 'metrics.csv'), 'w') as f:
    f.write(metrics)


def test_neutral_flags_may_change_and_hparams_json_stays(tmp_path):
  write_run(tmp_path)
  before = (tmp_path / 'hparams.json').read_text()
  plan = run_directory.check_resume(
      str(tmp_path), 2, {**STORED, 'total_rounds': 9, 'num_workers': 3,
                         'task_defaults_applied': {}, 'new_flag': 1})
  assert plan.hparams_to_write is None
  run_directory.finish_resume(str(tmp_path), plan)
  assert (tmp_path / 'hparams.json').read_text() == before


def test_changed_results_flags_are_refused_by_name(tmp_path):
  write_run(tmp_path)
  with pytest.raises(UsageError) as error:
    run_directory.check_resume(
        str(tmp_path), 2, {**STORED, 'seed': 1, 'client_learning_rate': 0.1,
                           'total_rounds': 9})
  assert str(error.value) == (
      f'{tmp_path} was trained with other values of flags that change '
      'results: --client_learning_rate (run: 0.01, now: 0.1), --seed (run: 0, '
      'now: 1); repeat the run\'s values, use a new --experiment_name, or '
      'pass --allow_flag_changes to continue with the new ones')


def test_flags_the_algorithm_does_not_read_are_not_compared(tmp_path):
  """FedAvg on CelebA records eta_c = eta * eta_s; a new eta changes it,
  but only --client_learning_rate is a change FedAvg makes."""
  write_run(tmp_path, {**STORED, 'central_learning_rate': 0.01})
  with pytest.raises(UsageError) as error:
    run_directory.check_resume(
        str(tmp_path), 2, {**STORED, 'client_learning_rate': 0.5,
                           'central_learning_rate': 0.5},
        unused=frozenset({'central_learning_rate'}))
  assert 'results: --client_learning_rate (run: 0.01, now: 0.5); ' in str(
      error.value)
  plan = run_directory.check_resume(
      str(tmp_path), 2, {**STORED, 'central_learning_rate': 0.5},
      unused=frozenset({'central_learning_rate'}))
  assert plan.hparams_to_write is None


def test_allowed_changes_are_recorded(tmp_path):
  write_run(tmp_path)
  plan = run_directory.check_resume(
      str(tmp_path), 2, {**STORED, 'seed': 1, 'total_rounds': 9},
      allow_flag_changes=True)
  run_directory.finish_resume(str(tmp_path), plan)
  written = json.loads((tmp_path / 'hparams.json').read_text())
  assert written['seed'] == 1
  assert written['total_rounds'] == 5  # Neutral values stay the run's.
  assert written['flag_changes'] == [
      {'from_round': 2, 'changes': {'seed': {'run': 0, 'now': 1}}}]
  # A second change appends; the recorded history is not compared.
  (tmp_path / 'metrics.csv').write_text(HEADER + rows(1, 2, 3, 4))
  plan = run_directory.check_resume(
      str(tmp_path), 4, {**STORED, 'seed': 2}, allow_flag_changes=True)
  run_directory.finish_resume(str(tmp_path), plan)
  written = json.loads((tmp_path / 'hparams.json').read_text())
  assert [c['from_round'] for c in written['flag_changes']] == [2, 4]


def test_result_changes_compare_as_json():
  assert not run_directory.result_changes({'ids': [1, 2]}, {'ids': (1, 2)})
  assert run_directory.result_changes({'x': 1}, {'x': 1.5}) == {'x': (1, 1.5)}


def test_a_key_hparams_json_lacks_is_compared_with_its_default(tmp_path):
  # 'client_learning_rate' deleted from the file (or a flag newer than the
  # run): a value given other than the flag's default is a change, its
  # default (what the run had before the flag existed) is not.
  stored = {k: v for k, v in STORED.items() if k != 'client_learning_rate'}
  write_run(tmp_path, stored)
  current = {**STORED, 'client_learning_rate': 0.5, 'new_flag': 2}
  with pytest.raises(UsageError) as error:
    run_directory.check_resume(
        str(tmp_path), 2, current,
        defaults={'client_learning_rate': 0.01, 'new_flag': 2})
  assert ('results: --client_learning_rate (run: not in hparams.json, now: '
          '0.5); repeat') in str(error.value)
  plan = run_directory.check_resume(
      str(tmp_path), 2, {**current, 'client_learning_rate': 0.01},
      defaults={'client_learning_rate': 0.01, 'new_flag': 2})
  assert plan.hparams_to_write is None
  # Allowed, the change is recorded without a run value.
  plan = run_directory.check_resume(
      str(tmp_path), 2, current, allow_flag_changes=True,
      defaults={'client_learning_rate': 0.01})
  run_directory.finish_resume(str(tmp_path), plan)
  written = json.loads((tmp_path / 'hparams.json').read_text())
  assert written['client_learning_rate'] == 0.5
  assert written['flag_changes'] == [{'from_round': 2, 'changes': {
      'client_learning_rate': {'now': 0.5}}}]


@pytest.mark.parametrize('content, message', [
    (b'\xff\xfe', 'is not UTF-8 text (byte 0)'),
    (b'[1, 2]', 'must hold a JSON object of flag values, not a list'),
    (b'{"seed": ', 'is not valid JSON'),
])
def test_damaged_hparams_json(tmp_path, content, message):
  write_run(tmp_path)
  (tmp_path / 'hparams.json').write_bytes(content)
  with pytest.raises(UsageError, match='hparams.json ' + message.replace(
      '(', r'\(').replace(')', r'\)')):
    run_directory.check_resume(str(tmp_path), 2, STORED)


def test_a_damaged_hparams_json_is_refused_before_it_is_compared(tmp_path):
  # A value no flag takes was reported as a changed flag.
  write_run(tmp_path, {**STORED, 'seed': [1]})

  def check_stored(stored, path):
    if not isinstance(stored['seed'], int):
      raise UsageError(f'{path}: seed is damaged')
  with pytest.raises(UsageError, match=r'hparams.json: seed is damaged$'):
    run_directory.check_resume(str(tmp_path), 2, STORED,
                               check_stored=check_stored)
  # flag_changes too, and without --allow_flag_changes.
  write_run(tmp_path, {**STORED, 'flag_changes': 5})
  with pytest.raises(UsageError, match='flag_changes must be a list'):
    run_directory.check_resume(str(tmp_path), 2, STORED)


def test_rows_without_a_checkpoint_are_refused(tmp_path):
  write_run(tmp_path)
  with pytest.raises(UsageError, match='has no checkpoint to resume'):
    run_directory.check_resume(str(tmp_path), None, STORED)


# -- metrics.csv and TensorBoard --------------------------------------------

def test_partial_row_and_rows_after_the_checkpoint_are_trimmed(
    tmp_path, caplog):
  path = tmp_path / 'metrics.csv'
  path.write_text(HEADER + rows(1, 2, 3, 4) + '5,0.5')
  run_logs.trim_metrics(str(path), 3)
  assert path.read_text() == HEADER + rows(1, 2, 3)
  assert any('the rows of rounds 4' in r.getMessage() and
             'partial last row' in r.getMessage() for r in caplog.records)
  caplog.clear()
  run_logs.trim_metrics(str(path), 3)  # Nothing to do: untouched, silent.
  assert path.read_text() == HEADER + rows(1, 2, 3)
  assert not caplog.records


@pytest.mark.parametrize('content, message', [
    ('', 'is empty'),
    ('hello world\n1,2\n', 'does not start with a round_num column'),
    (HEADER + '1,0.1\n2,0.2,1.0\n', 'line 2 is not a row of its columns'),
    (HEADER + 'x,0.1,1.0\n', 'line 2 is not a row of its columns'),
])
def test_damaged_metrics_are_refused(tmp_path, content, message):
  path = tmp_path / 'metrics.csv'
  path.write_text(content)
  with pytest.raises(UsageError) as error:
    run_logs.trim_metrics(str(path), 3)
  assert str(error.value) == (
      f'{path} {message}; it is not a metrics file of this pipeline: restore '
      'it, or use a new --experiment_name')
  assert path.read_text() == content


@pytest.mark.parametrize('content, last_round, problem', [
    (None, 6, ' is missing, but the run has checkpoint round 6: the rows of '
     'rounds 1-6 are lost'),
    (HEADER, 1, ': the row of round 1 is missing, up to checkpoint round 1'),
    (HEADER + rows(1, 2, 3), 6,
     ': the rows of rounds 4-6 are missing, up to checkpoint round 6'),
    (HEADER + rows(1, 2) + '3,0.', 6,
     ': the rows of rounds 3-6 are missing (the row of round 3 was cut off '
     'mid-write), up to checkpoint round 6'),
    (HEADER + rows(1, 2, 4, 5, 6), 6,
     ': the row of round 3 is missing, up to checkpoint round 6'),
    (HEADER + rows(1, 2, 2, 3, 4, 5, 6), 6,
     ': line 4 repeats the row of round 2, up to checkpoint round 6'),
    (HEADER + rows(1, 2, 3, 4, 5, 6, 7, 4), 6,
     ': line 9 repeats the row of round 4, up to checkpoint round 6'),
    (HEADER + rows(1, 3, 2, 4), 4,
     ': its rows are out of order (line 3 holds round 3 where round 2 '
     'belongs), up to checkpoint round 4'),
])
def test_metrics_without_one_row_per_checkpointed_round_are_refused(
    tmp_path, content, last_round, problem):
  """Rows a kill cannot lose: the resume would record those rounds never or
  twice. Refused before anything changes."""
  write_run(tmp_path, metrics=content or '')
  if content is None:
    os.remove(tmp_path / 'metrics.csv')
  before = lib.tree_digest(str(tmp_path))
  with pytest.raises(UsageError) as error:
    run_directory.check_resume(str(tmp_path), last_round, STORED)
  assert str(error.value) == (
      f'{tmp_path / "metrics.csv"}{problem}; restore the file, or use a new '
      '--experiment_name (the run cannot record those rounds again)')
  with pytest.raises(UsageError):
    run_logs.trim_metrics(str(tmp_path / 'metrics.csv'), last_round)
  assert lib.tree_digest(str(tmp_path)) == before


def test_metrics_missing_before_the_first_round_is_fine(tmp_path):
  # Killed after checkpoint 0, before round 1 was logged.
  write_run(tmp_path)
  os.remove(tmp_path / 'metrics.csv')
  run_directory.finish_resume(
      str(tmp_path), run_directory.check_resume(str(tmp_path), 0, STORED))
  assert not (tmp_path / 'metrics.csv').exists()


def test_an_unparsable_row_names_the_round_before_it(tmp_path):
  path = tmp_path / 'metrics.csv'
  path.write_text(HEADER + rows(1, 2) + 'zz\n' + rows(4))
  with pytest.raises(UsageError, match=r'line 4 \(after the row of round 2\) '
                     'is not a row of its columns'):
    run_logs.trim_metrics(str(path), 4)


def test_metrics_directory_is_refused(tmp_path):
  (tmp_path / 'metrics.csv').mkdir()
  with pytest.raises(UsageError, match='metrics.csv is a directory'):
    run_logs.read_metrics(str(tmp_path / 'metrics.csv'))




def scalar_steps(directory):
  steps = []
  for path in run_logs.event_files(str(directory)):
    records, cut_off = run_logs.read_events(path)
    assert not cut_off
    from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
    for record in records:
      event = event_pb2.Event.FromString(record)
      steps += [event.step for _ in event.summary.value]
  return sorted(steps)


def test_tensorboard_steps_after_the_checkpoint_are_removed(tmp_path):
  # A run killed after round 5 with checkpoint 3, resumed, killed after 4.
  write_events(tmp_path, [1, 2, 3, 4, 5])
  run_logs.trim_tensorboard(str(tmp_path), 3)
  write_events(tmp_path, [4])
  path = run_logs.event_files(str(tmp_path))[-1]
  with open(path, 'rb+') as f:  # The kill cut the last record's CRC off.
    f.truncate(os.path.getsize(path) - 2)
  assert run_logs.read_events(path)[1]
  run_logs.trim_tensorboard(str(tmp_path), 3)
  assert not run_logs.read_events(path)[1]
  write_events(tmp_path, [4, 5, 6])
  assert scalar_steps(tmp_path) == [1, 2, 3, 4, 5, 6]


def write_logged(directory, scalars):
  """Events as the driver's TensorBoard release writes them: {round: {name:
  value}}."""
  writer = tf.summary.create_file_writer(str(directory))
  with writer.as_default():
    for step, values in scalars.items():
      for name, value in values.items():
        tf.summary.scalar(name, value, step=step)
  writer.close()
  time.sleep(1.1)  # Event file names hold the second they were made in.


# Rounds 1-3 as logged; round 2 evaluated.
LOGGED = {r: {'train/loss': r / 10, 'round_seconds': 1.5,
              **({'eval/loss': 0.25} if r == 2 else {})} for r in (1, 2, 3)}
EVAL_HEADER = 'round_num,round_seconds,train/loss,eval/loss\n'
EVAL_ROWS = '1,1.5,0.1,\n2,1.5,0.2,0.25\n3,1.5,0.3,\n'


def test_columns_as_logged_resume(tmp_path):
  """A column may be empty in rounds without evaluation, be added later,
  stay in the header after its rows were dropped, and rounds whose events
  were lost (or cut short) by a kill are not compared."""
  write_run(tmp_path, metrics=EVAL_HEADER.replace('\n', ',eval/acc\n') +
            EVAL_ROWS.replace('\n', ',\n') + '4,1.5,0.4,0.3,0.9\n')
  write_logged(tmp_path / 'tensorboard',
               {**LOGGED, 3: {'train/loss': 0.3}, 4: {'train/loss': 0.4}})
  plan = run_directory.check_resume(str(tmp_path), 3, STORED)
  run_directory.finish_resume(str(tmp_path), plan)
  assert (tmp_path / 'metrics.csv').read_text() == (
      EVAL_HEADER.replace('\n', ',eval/acc\n') +
      EVAL_ROWS.replace('\n', ',\n'))


@pytest.mark.parametrize('header, problem', [
    # Renamed: the resumed rows would put train/loss into a new column.
    ('round_num,round_seconds,train/lozz,eval/loss',
     'no column train/loss (logged for rounds 1-3); column train/lozz holds '
     'values the run did not log'),
    ('round_num,round_seconds,train/loss,eval/l\u00f6ss',
     'no column eval/loss (logged for round 2); column eval/l\u00f6ss holds '
     'values the run did not log'),
    # Swapped: every name is there, holding the other's values.
    ('round_num,train/loss,round_seconds,eval/loss',
     'column round_seconds holds 0.1 in the row of round 1, where the run '
     'logged 1.5'),
])
def test_a_changed_column_name_is_refused(tmp_path, header, problem):
  write_run(tmp_path, metrics=header + '\n' + EVAL_ROWS)
  write_logged(tmp_path / 'tensorboard', LOGGED)
  before = lib.tree_digest(str(tmp_path))
  with pytest.raises(UsageError) as error:
    run_directory.check_resume(str(tmp_path), 3, STORED)
  assert str(error.value) == (
      f'{tmp_path / "metrics.csv"}: its header does not name the columns the '
      'run wrote (compared with the events in '
      f'{tmp_path / "tensorboard"}): {problem}; restore the header, or use a '
      'new --experiment_name')
  assert lib.tree_digest(str(tmp_path)) == before


def test_a_column_named_twice_is_refused(tmp_path):
  path = tmp_path / 'metrics.csv'
  path.write_text('round_num,train/loss,train/loss\n1,0.1,0.2\n')
  with pytest.raises(UsageError, match='names the column train/loss twice'):
    run_logs.trim_metrics(str(path), 1)


def write_events(directory, steps):
  write_logged(directory, {step: {'train/loss': float(step)} for step in steps})


def events_file(directory, steps):
  write_events(directory, steps)
  return run_logs.event_files(str(directory))[-1]


def overwrite(path, offset, data):
  with open(path, 'rb+') as f:
    f.seek(offset)
    f.write(data)


def assert_refused_unchanged(run_dir, match):
  before = lib.tree_digest(str(run_dir))
  with pytest.raises(UsageError, match=match):
    run_directory.check_resume(str(run_dir), 2, STORED)
  with pytest.raises(UsageError, match=match):
    run_logs.trim_tensorboard(str(run_dir / 'tensorboard'), 2)
  assert lib.tree_digest(str(run_dir)) == before


def test_events_damaged_before_the_last_record_are_refused(tmp_path):
  # A kill only cuts the last record short; bytes changed in the middle
  # are damage, and cutting the file there would lose the rounds after.
  write_run(tmp_path)
  path = events_file(tmp_path / 'tensorboard', [1, 2, 3, 4])
  records, _ = run_logs.read_events(path)
  second = len(records[0]) + 16  # The first scalar's record.
  overwrite(path, second + 14, b'\xff' * 6)
  assert_refused_unchanged(
      tmp_path, f'^{path} is damaged at byte {second} \\(record 2\\) with '
      r'\d+ bytes from there: not a cut-off last record.*without its events$')
  # The last record complete but wrong is damage too, not a cut-off write.
  overwrite(path, second + 14, records[1][2:8])
  assert run_logs.read_events(path) == (records, False)
  overwrite(path, os.path.getsize(path) - 6, b'\x00\x01')
  assert_refused_unchanged(tmp_path, 'is damaged at byte')


@pytest.mark.parametrize('content', [
    b'not an events file\n' * 20, b'abc', b'\x00' * 40,
    # A TFRecord file, but not of events.
    None,
])
def test_foreign_events_files_are_refused_not_truncated(tmp_path, content):
  write_run(tmp_path)
  path = tmp_path / 'tensorboard' / 'events.out.tfevents.123.host'
  path.parent.mkdir()
  if content is None:
    with tf.io.TFRecordWriter(str(path)) as writer:
      writer.write(b'some record')
  else:
    path.write_bytes(content)
  before = lib.tree_digest(str(tmp_path))
  with pytest.raises(UsageError, match=f'^{path} is not a TensorBoard events '
                     'file .*; move it out of the run\'s tensorboard '
                     'directory to resume without its events$'):
    run_directory.check_resume(str(tmp_path), None, None)
  with pytest.raises(UsageError):
    run_logs.trim_tensorboard(str(tmp_path / 'tensorboard'), 0)
  assert lib.tree_digest(str(tmp_path)) == before


def test_a_cut_off_first_record_is_removed_an_empty_file_kept(tmp_path):
  # A kill (or a full disk) while TF made the file: nothing of ours is lost.
  path = events_file(tmp_path, [1])
  first = open(path, 'rb').read()[:30]
  for size in (0, 5, 12, 30):
    with open(path, 'wb') as f:
      f.write(first[:size])
    run_logs.check_tensorboard(str(tmp_path))
    run_logs.trim_tensorboard(str(tmp_path), 0)
    assert os.path.exists(path) == (size == 0)


def test_cut_off_writes_are_removed(tmp_path):
  (tmp_path / 'checkpoints' / 'round_4_temp1234' / 'variables').mkdir(
      parents=True)
  (tmp_path / 'checkpoints' / 'round_4').mkdir()
  (tmp_path / 'metrics.csv_temp5678').write_text('x')
  (tmp_path / 'hparams.json.staging').write_text('x')
  (tmp_path / 'metrics.csv.staging').write_text('x')
  # An export killed with its previous export moved aside: that goes back.
  (tmp_path / 'export.k2_x9qab.staging' / 'old').mkdir(parents=True)
  (tmp_path / 'export.k2_x9qab.staging' / 'old' / 'saved_model.pb').write_text(
      'previous')
  (tmp_path / 'export.k2_x9qab.staging' / 'new').mkdir()
  # One whose target is there (killed before or after the swap): it goes.
  (tmp_path / 'final.abcdefgh.staging' / 'old').mkdir(parents=True)
  (tmp_path / 'final').mkdir()
  (tmp_path / 'final' / 'saved_model.pb').write_text('current')
  (tmp_path / 'tensorboard' / 'train').mkdir(parents=True)
  (tmp_path / 'tensorboard' / 'train' /
   'events.out.tfevents.1.host.staging').write_text('x')
  (tmp_path / 'metrics.csv').write_text(HEADER)
  # A user's files of other names are kept.
  users = ['notes.staging', 'data_temp1', 'my.export.staging']
  for name in users:
    (tmp_path / name).write_text('mine')
  (tmp_path / 'tensorboard' / 'plot.staging').write_text('mine')
  (tmp_path / 'checkpoints' / 'notes.staging').write_text('mine')
  run_directory.remove_cut_off_writes(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == sorted(
      ['checkpoints', 'metrics.csv', 'tensorboard', 'export', 'final', *users])
  assert (tmp_path / 'export' / 'saved_model.pb').read_text() == 'previous'
  assert os.listdir(tmp_path / 'final') == ['saved_model.pb']
  assert (tmp_path / 'final' / 'saved_model.pb').read_text() == 'current'
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['notes.staging',
                                                          'round_4']
  assert sorted(os.listdir(tmp_path / 'tensorboard')) == ['plot.staging',
                                                          'train']
  assert os.listdir(tmp_path / 'tensorboard' / 'train') == []


# -- lock, names, export targets ---------------------------------------------

def test_a_refused_start_removes_only_what_it_made_and_left_empty(tmp_path):
  new_run = tmp_path / 'new'
  with run_directory.RunLock(str(new_run)):
    (new_run / 'checkpoints').mkdir()
    run_directory.remove_unwritten(str(new_run), None)
  assert not new_run.exists()

  run = tmp_path / 'run'
  (run / 'tensorboard').mkdir(parents=True)
  (run / 'notes.txt').write_text('mine')
  before = run_directory.entries(str(run))
  with run_directory.RunLock(str(run)):
    (run / 'checkpoints' / 'round_0').mkdir(parents=True)
    (run / 'client_states').mkdir()
    run_directory.remove_unwritten(str(run), before)
  assert sorted(os.listdir(run)) == ['notes.txt', 'tensorboard']

  # Anything written (a checkpoint) keeps the start's files, lock included.
  with run_directory.RunLock(str(new_run)):
    (new_run / 'checkpoints').mkdir()
    (new_run / 'checkpoints' / 'state').write_text('x')
    run_directory.remove_unwritten(str(new_run), None)
  assert sorted(os.listdir(new_run)) == ['.lock', 'checkpoints']


def test_second_process_cannot_lock_a_run(tmp_path):
  with lib.lock_held_by_another_process(tmp_path):
    with pytest.raises(UsageError) as error:
      run_directory.RunLock(str(tmp_path)).acquire()
    assert str(error.value) == (
        f'{tmp_path} is in use by another process (it holds '
        f'{tmp_path}/.lock); wait for it to finish, or use another '
        '--experiment_name')
  # The kernel dropped the dead holder's lock.
  with run_directory.RunLock(str(tmp_path)):
    pass


@pytest.mark.parametrize('name', ['..', '.', 'a/b', '../x', ''])
def test_experiment_names_that_leave_the_root(tmp_path, name):
  with pytest.raises(UsageError, match='--experiment_name'):
    run_directory.run_dir_path(str(tmp_path), name)


def test_root_output_dir_that_is_a_file(tmp_path):
  (tmp_path / 'f').write_text('')
  with pytest.raises(UsageError, match='is a file, not a directory'):
    run_directory.run_dir_path(str(tmp_path / 'f'), 'x')


@pytest.fixture
def run_tree(tmp_path):
  run = tmp_path / 'root' / 'run'
  (run / 'checkpoints').mkdir(parents=True)
  (run / 'metrics.csv').write_text(HEADER)
  (run / 'export').mkdir()
  (run / 'export' / 'saved_model.pb').write_text('')
  (tmp_path / 'other').mkdir()
  (tmp_path / 'other' / 'notes.txt').write_text('mine')
  # An export holding a file of the user's.
  (tmp_path / 'annotated' / 'variables').mkdir(parents=True)
  (tmp_path / 'annotated' / 'saved_model.pb').write_text('')
  (tmp_path / 'annotated' / 'variables' / 'NOTES.txt').write_text('mine')
  # Another run, with its export.
  (tmp_path / 'root' / 'otherrun' / 'export').mkdir(parents=True)
  (tmp_path / 'root' / 'otherrun' / 'hparams.json').write_text('{}')
  (tmp_path / 'root' / 'otherrun' / 'export' / 'saved_model.pb').write_text('')
  return run


@pytest.mark.parametrize('target, message', [
    ('root/run', 'would replace the run directory'),
    ('root', 'would replace the run directory'),
    ('root/run/checkpoints', 'is inside the run directory'),
    ('root/run/export/x', 'is inside the run directory'),
    ('other', 'holds notes.txt, which is not part of an export'),
    ('annotated', 'holds variables/NOTES.txt, which is not part of an export'),
    ('root/otherrun/export', 'is inside the directory of another run, '),
    ('root/otherrun/new/export', 'is inside the directory of another run, '),
    ('root/run/metrics.csv', 'is inside the run directory'),
])
def test_export_targets_that_would_replace_something(run_tree, target,
                                                      message):
  base = run_tree.parent.parent
  with pytest.raises(UsageError, match=message):
    export_lib.check_export_dir(str(base / target), str(run_tree))


def test_export_targets_that_are_fine(run_tree, tmp_path):
  for target in (run_tree / 'export', tmp_path / 'new', tmp_path / 'other2'):
    export_lib.check_export_dir(str(target), str(run_tree))
  (tmp_path / 'copy').mkdir()
  (tmp_path / 'copy' / 'checkpoints').mkdir()
  with pytest.raises(UsageError, match='holds a run'):
    export_lib.check_export_dir(str(tmp_path / 'copy'), str(run_tree))


@pytest.fixture(scope='module')
def small_model():
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tasks import base  # pylint: disable=g-import-not-at-top
  from tasks import fedres_synthetic  # pylint: disable=g-import-not-at-top
  task = fedres_synthetic.build_logistic_task(base.DataConfig(
      client_steps=1, client_batch_size=10, seed=0))
  return task, tff.learning.models.ModelWeights.from_model(
      task.keras_model_fn())


def test_export_deletes_only_what_it_wrote(small_model, tmp_path):
  task, weights = small_model
  target = tmp_path / 'mymodel'
  # A user's backup and a directory of the names earlier versions used.
  for sibling in ('mymodel.old', 'mymodel.staging'):
    (tmp_path / sibling).mkdir()
    (tmp_path / sibling / 'b.txt').write_text('mine')
  siblings = [lib.tree_digest(tmp_path / name)
              for name in ('mymodel.old', 'mymodel.staging')]
  for _ in range(2):  # A new export, then one replacing it.
    export_lib.export_saved_model(task, weights, str(target))
    assert sorted(os.listdir(tmp_path)) == [
        'mymodel', 'mymodel.old', 'mymodel.staging']
  assert export_lib.load_model_weights(str(target), task) is not None
  (target / 'NOTES.txt').write_text('mine')
  exported = lib.tree_digest(tmp_path)
  with pytest.raises(UsageError) as error:
    export_lib.export_saved_model(task, weights, str(target))
  assert str(error.value) == (
      f'{target} holds NOTES.txt, which is not part of an export of this '
      'pipeline: replacing the export would lose it; move it away')
  assert lib.tree_digest(tmp_path) == exported
  assert siblings == [lib.tree_digest(tmp_path / name)
                      for name in ('mymodel.old', 'mymodel.staging')]


def test_a_killed_exports_staging_goes_and_its_old_export_comes_back(
    small_model, tmp_path, monkeypatch):
  task, weights = small_model
  target = tmp_path / 'mymodel'
  export_lib.export_saved_model(task, weights, str(target))
  exported = lib.tree_digest(target)
  # Killed between moving the old export aside and the new one in: its
  # owner lock is free.
  killed = tmp_path / 'mymodel.k2_x9qab.staging'
  killed.mkdir()
  os.close(private_temp.lock_as_owner(str(killed)))
  os.rename(target, killed / 'old')
  (killed / 'new').mkdir()
  # An export still running (its lock held), and a name that is not an
  # export's.
  running = tmp_path / 'mymodel.abcdefgh.staging'
  running.mkdir()
  running_lock = private_temp.lock_as_owner(str(running))
  users = tmp_path / 'mymodel.x.staging'
  users.mkdir()
  try:
    def fail_to_write(*args, **kwargs):
      raise OSError(errno.ENOSPC, 'No space left on device', str(tmp_path))

    with monkeypatch.context() as patch, pytest.raises(OSError):
      patch.setattr(tf.saved_model, 'save', fail_to_write)
      export_lib.export_saved_model(task, weights, str(target))
    # The old export is back, though the new one could not be written.
    assert lib.tree_digest(target) == exported
    assert sorted(os.listdir(tmp_path)) == sorted(
        ['mymodel', running.name, users.name])
    export_lib.export_saved_model(task, weights, str(target))
    assert sorted(os.listdir(tmp_path)) == sorted(
        ['mymodel', running.name, users.name])
  finally:
    os.close(running_lock)


# -- private temp directories ----------------------------------------------

def test_temp_dirs_of_ended_processes_are_removed(tmp_path):
  script = ('import sys, tempfile, time\n'
            'from pipeline import private_temp\n'
            'print(private_temp.use_private_temp_dir(), flush=True)\n'
            'open(tempfile.mkstemp(prefix="__autograph_generated_file")[1], '
            '"w")\n'
            'time.sleep(600)\n')
  env = {**os.environ, 'PYTHONPATH': REPO, 'TMPDIR': str(tmp_path)}
  ended = subprocess.Popen([sys.executable, '-c', script], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, text=True)
  alive = subprocess.Popen([sys.executable, '-c', script], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, text=True)
  try:
    ended_dir = ended.stdout.readline().strip()
    alive_dir = alive.stdout.readline().strip()
    ended.kill()
    ended.wait()
    assert os.listdir(ended_dir)  # SIGKILL left its files.
    assert private_temp.remove_stale(str(tmp_path)) == 1
    assert not os.path.exists(ended_dir)
    assert os.path.isdir(alive_dir)
  finally:
    alive.terminate()
    alive.wait()


def test_a_temp_dir_whose_lock_is_not_yet_named_is_kept(tmp_path,
                                                        monkeypatch):
  # lock_as_owner names its lock file only once it is locked: a lock file
  # made but not yet locked looked like one of an ended process, and
  # another process's start removed the directory of a live one.
  fresh = tmp_path / (private_temp.PREFIX + 'fresh')
  fresh.mkdir()
  flock, removed = private_temp.fcntl.flock, []

  def another_start_first(fd, operation):
    if not removed:  # Another process starts just before this one locks.
      removed.append(private_temp.remove_stale(str(tmp_path)))
    return flock(fd, operation)

  monkeypatch.setattr(private_temp.fcntl, 'flock', another_start_first)
  fd = private_temp.lock_as_owner(str(fresh))
  monkeypatch.undo()
  assert removed == [0] and fresh.is_dir()
  try:
    assert os.listdir(fresh) == ['.owner.lock']
    assert not private_temp.owner_is_gone(str(fresh))
  finally:
    os.close(fd)
  assert private_temp.owner_is_gone(str(fresh))


def test_a_replaced_file_is_whole_or_as_it_was(tmp_path):
  # evaluate wrote its report in place: a full disk emptied an earlier one.
  place = tmp_path / 'disk'
  with lib.small_filesystem(place, 64):
    path = place / 'evaluation_round_3.json'
    path.write_text('{"earlier": 1}')
    with pytest.raises(OSError) as raised:
      run_logs.replace_file(str(path), 'x' * 200_000)
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC,
                                                           str(path))
    assert path.read_text() == '{"earlier": 1}'
    assert os.listdir(place) == ['evaluation_round_3.json']


def test_two_writers_of_a_file_at_once_each_write_it_whole(tmp_path,
                                                          monkeypatch):
  # Two evaluates of a run (they take no lock) write the same report: they
  # shared `<path>.staging`, which the second truncated while the first had
  # written it; the first renamed it, then the second's rename failed (a
  # traceback), and the report could hold a mix of both.
  path = tmp_path / 'evaluation_round_3.json'
  fsync = os.fsync
  other_writes = []

  def fsync_while_another_writes(descriptor):
    if not other_writes:
      other_writes.append(1)
      run_logs.replace_file(str(path), '{"other": 1}')
    fsync(descriptor)

  monkeypatch.setattr(os, 'fsync', fsync_while_another_writes)
  run_logs.replace_file(str(path), '{"this one": 1, "longer": true}')
  assert path.read_text() == '{"this one": 1, "longer": true}'
  assert os.listdir(tmp_path) == ['evaluation_round_3.json']


def test_no_temp_file_leaks_after_the_private_dir_is_removed(tmp_path):
  # On SIGTERM the handler removes the private directory, and another thread
  # (TFF's checkpoint writer tracing its tf.function) may still make an
  # autograph file before the re-raised signal ends the process, which then
  # runs no atexit hook: that file went to the shared TMPDIR, for good.
  script = ('import os, signal, tempfile, threading\n'
            'from pipeline import private_temp\n'
            'private_temp.use_private_temp_dir()\n'
            'removed = threading.Event()\n'
            'def writer():\n'
            '  removed.wait()\n'
            '  try:\n'
            '    tempfile.mkstemp(prefix="__autograph_generated_file")\n'
            '  except OSError:\n'
            '    pass\n'
            '  os.kill(os.getpid(), signal.SIGKILL)  # The re-raised signal.\n'
            'threading.Thread(target=writer).start()\n'
            'private_temp.remove_private_temp_dir()  # The SIGTERM handler.\n'
            'removed.set()\n'
            'threading.Event().wait(60)\n')
  env = {**os.environ, 'PYTHONPATH': REPO, 'TMPDIR': str(tmp_path)}
  process = subprocess.run([sys.executable, '-c', script], cwd=REPO, env=env,
                           timeout=60, check=False)
  assert process.returncode == -9
  assert os.listdir(tmp_path) == []


def test_private_temp_dir_can_be_made_again_after_removal(tmp_path):
  script = ('import os, tempfile\n'
            'from pipeline import private_temp\n'
            'first = private_temp.use_private_temp_dir()\n'
            'private_temp.remove_private_temp_dir()\n'
            'second = private_temp.use_private_temp_dir()\n'
            'assert second != first and os.path.dirname(second) == '
            'os.path.dirname(first), (first, second)\n'
            'assert tempfile.mkstemp(dir=None)[1].startswith(second)\n'
            'private_temp.remove_private_temp_dir()\n')
  env = {**os.environ, 'PYTHONPATH': REPO, 'TMPDIR': str(tmp_path)}
  subprocess.run([sys.executable, '-c', script], cwd=REPO, env=env,
                 timeout=60, check=True)
  assert os.listdir(tmp_path) == []

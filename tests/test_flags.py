"""Flag validation that needs no training run."""

import inspect
import json
import os
import re

import pytest
from absl import flags

from binaries import app
from binaries import flags_lib
from pipeline.errors import UsageError
from tasks import registry as task_registry


@pytest.fixture
def parsed_flags():
  def parse(*args):
    flags.FLAGS.unparse_flags()
    flags.FLAGS(['prog', *args])
    return flags.FLAGS
  yield parse
  flags.FLAGS.unparse_flags()


def test_flag_that_does_not_apply_is_rejected(parsed_flags):
  parsed_flags('--scaffold_option=1')
  with pytest.raises(UsageError, match='--scaffold_option does not apply to '
                     '--algorithm=fedavg'):
    app.check_flags_apply('algorithm=fedavg', ('client_learning_rate',),
                          flags_lib.ALGORITHM_FLAGS)


def test_flags_left_at_default_are_fine(parsed_flags):
  parsed_flags('--client_learning_rate=0.1')
  app.check_flags_apply('algorithm=fedavg', ('client_learning_rate',),
                        flags_lib.ALGORITHM_FLAGS)


def test_missing_required_flags(parsed_flags):
  parsed_flags()
  with pytest.raises(UsageError, match='--task, --algorithm'):
    app.require_flags('task', 'algorithm')


def test_hparams_hold_every_flag(parsed_flags):
  parsed_flags('--total_rounds=7')
  values = flags_lib.all_values()
  assert values['total_rounds'] == 7
  for name in flags_lib.ALGORITHM_FLAGS:
    assert name in values


def test_task_option_the_task_does_not_read_is_rejected(parsed_flags):
  parsed_flags('--task=celeba_smile', '--similarity=0.5')
  with pytest.raises(UsageError, match='--similarity does not apply to '
                     '--task=celeba_smile'):
    flags_lib.data_config()


def test_task_options_the_task_reads_pass_through(parsed_flags):
  parsed_flags('--task=digits', '--similarity=0.5', '--num_clients=7')
  options = flags_lib.data_config().options
  assert options['similarity'] == 0.5 and options['num_clients'] == 7
  assert 'celeba_mode' not in task_registry.options('digits')


@pytest.mark.parametrize('task', task_registry.NAMES)
def test_declared_task_options_are_the_option_flags_the_task_reads(task):
  """registry.options(task) must match the option flags its module reads, or
  a flag it uses would be rejected (or one it ignores accepted)."""
  module = inspect.getmodule(task_registry._BUILDERS[task])
  source = inspect.getsource(module)
  read = set(re.findall(
      r"(?:options\.get\(|positive_option\(\s*options,)\s*'(\w+)'", source))
  assert read & set(flags_lib.TASK_OPTION_FLAGS) == set(
      task_registry.options(task))


class _Population:
  def __init__(self, num_train_clients, default_clients_per_round=None):
    self.num_train_clients = num_train_clients
    self.default_clients_per_round = default_clients_per_round


@pytest.mark.parametrize('args,task,expected', [
    # fedres_toy: 2 clients, fewer than the flag's default of 10: all of them.
    ((), _Population(2), 2),
    ((), _Population(50), 10),
    ((), _Population(7, default_clients_per_round=5), 5),
    # The command line wins (the driver rejects an impossible value).
    (('--clients_per_round=3',), _Population(2), 3),
])
def test_clients_per_round_defaults_to_at_most_the_population(
    parsed_flags, args, task, expected):
  parsed_flags(*args)
  flags_lib.apply_built_task_defaults(task)
  assert flags.FLAGS.clients_per_round == expected


@pytest.mark.parametrize('key,value,why', [
    # A resume reported these as changed flags (run: "abc", now: 0).
    ('seed', 'abc', 'a string where it takes an integer'),
    ('client_learning_rate', [1, 2], 'a list where it takes a number'),
    # absl's parsers take a string of any flag, and 1 for True.
    ('client_learning_rate', '0.5', 'a string where it takes a number'),
    ('clients_per_round', True, 'true/false where it takes an integer'),
    ('use_synthetic_data', 1, 'a number where it takes true/false'),
    ('clients_per_round', None, 'null where it takes an integer'),
    ('total_rounds', 'abc', 'a string where it takes an integer'),
    ('runtime', 'gpu', 'value should be one of <tff|native>'),
])
def test_a_stored_value_no_flag_takes_is_a_damaged_hparams_json(key, value,
                                                                 why):
  hparams = {**flags_lib.all_values(), key: value}
  with pytest.raises(UsageError) as error:
    flags_lib.check_stored_values(hparams, 'run/hparams.json')
  assert str(error.value) == (
      f'run/hparams.json: {key}={json.dumps(value)} is not a valid --{key} '
      f'({why}): the file is damaged')


def test_an_unknown_key_is_a_damaged_hparams_json():
  # It was accepted on resume, and ignored by evaluate and export.
  hparams = {**flags_lib.all_values(), 'client_lerning_rate': 0.5}
  with pytest.raises(UsageError) as error:
    flags_lib.check_stored_values(hparams, 'run/hparams.json')
  assert str(error.value) == (
      "run/hparams.json: 'client_lerning_rate' is no flag of this pipeline "
      '(binaries.train writes only flags there): the file is damaged')
  with pytest.raises(UsageError, match='task_defaults_applied must be an '
                     'object'):
    flags_lib.check_stored_values({'task_defaults_applied': 3}, 'h')


def test_what_train_writes_and_older_versions_wrote_is_accepted():
  # Defaults of None; the keys that are no flag; --client_state_store, a
  # flag until 2026-11-23 (a run of then holds it).
  flags_lib.check_stored_values(
      {**flags_lib.all_values(), 'client_learning_rate': 1,
       'task_defaults_applied': {'client_steps': 2},
       'flag_changes': [{'from_round': 2, 'changes': {}}],
       'client_state_store': 'sqlite'}, 'run/hparams.json')


def test_a_run_is_read_where_it_is_found(parsed_flags, tmp_path, monkeypatch):
  # Copied under the default --root_output_dir (runs/): evaluate read the
  # checkpoints of, and wrote its report into, the run at the root
  # hparams.json records, which may be another run.
  from binaries import restore  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  parsed_flags('--experiment_name=copy')
  os.makedirs('runs/copy')
  with open('runs/copy/hparams.json', 'w') as f:
    json.dump({**flags_lib.all_values(), 'task': 'digits',
               'algorithm': 'fedavg', 'experiment_name': 'original',
               'root_output_dir': str(tmp_path / 'elsewhere')}, f)
  restore.load_run_flags()
  assert restore.run_dir() == 'runs/copy'

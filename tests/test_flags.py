"""Flag validation that needs no training run."""

import inspect
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

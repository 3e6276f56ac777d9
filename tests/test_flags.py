"""Flag validation that needs no training run."""

import pytest
from absl import flags

from binaries import app
from binaries import flags_lib
from pipeline.errors import UsageError


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
    app.check_flags_apply('fedavg', ('client_learning_rate',),
                          flags_lib.ALGORITHM_FLAGS)


def test_flags_left_at_default_are_fine(parsed_flags):
  parsed_flags('--client_learning_rate=0.1')
  app.check_flags_apply('fedavg', ('client_learning_rate',),
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

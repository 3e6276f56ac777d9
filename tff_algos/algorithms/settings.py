"""Typed, frozen settings of the algorithms, and the fields they share.

Each algorithm has a frozen dataclass of its settings; its fields are the
algorithm's command-line flags (same names), their help text and their
validation, and `hparams.json` records them. Adding a setting is one field
(and its use). A field several algorithms share is defined once here.

Validation raises `SettingError`, a `ValueError` naming the setting; the
binaries turn it into the one-line `error: --<name> ...`.
"""

import dataclasses
import math
from typing import Any, Optional, Sequence

import tensorflow_federated as tff

OPTIMIZERS = ('sgd', 'sgdm', 'adam', 'yogi', 'adagrad', 'rmsprop')
CLIENT_WEIGHTINGS = ('num_examples', 'uniform')


class SettingError(ValueError):
  """An impossible value of one setting."""

  def __init__(self, name: str, problem: str):
    self.name = name
    self.problem = problem
    # A problem that starts with the value ('=3 is unknown') follows the
    # name directly, as the flag is written.
    separator = '' if problem.startswith('=') else ' '
    super().__init__(f'{name}{separator}{problem}')


POSITIVE = 'positive'
DEFAULT_PER_ALGORITHM = 'default_per_algorithm'
NON_NEGATIVE = 'non_negative'


def setting(default: Any, help_text: str,
            choices: Optional[Sequence[Any]] = None,
            bound: Optional[str] = None, role: str = '',
            default_per_algorithm: bool = False) -> Any:
  """A settings field: its default, flag help and allowed values.

  `bound` is POSITIVE or NON_NEGATIVE for numbers that must be finite and
  > 0 or >= 0; `role` says what the value is in its bound's error. A field
  several algorithms share has one default for all of them, unless
  `default_per_algorithm` (its flag then defaults to each algorithm's).
  """
  metadata = {'help': help_text}
  if default_per_algorithm:
    metadata[DEFAULT_PER_ALGORITHM] = True
  if role:
    metadata['role'] = role
  if choices is not None:
    metadata['choices'] = tuple(choices)
  if bound is not None:
    metadata['bound'] = bound
  return dataclasses.field(default=default, metadata=metadata)


# Fields shared by several algorithms (each call makes a fresh field).
def client_optimizer():
  return setting('sgd', 'Client optimizer (tff.learning.optimizers).',
                 OPTIMIZERS)


def client_learning_rate():
  return setting(0.01, 'Client learning rate eta.', bound=POSITIVE,
                 role='the step size of the client_optimizer')


def server_optimizer():
  return setting('sgd', 'Server optimizer (tff.learning.optimizers).',
                 OPTIMIZERS)


def server_learning_rate():
  return setting(1.0, 'Server learning rate eta_s.', bound=POSITIVE)


def factored_control_variates():
  return setting(
      True, 'Keep a Dense kernel\'s c_i as the factors A^T E of its mean '
      'gradient where that is exact and smaller (SCAFFOLD/FedPVR option 2, '
      'FedResAvg option 2, with --client_steps; docs/scaffold.md); false: '
      'every c_i dense.')


def client_weighting(paper_default: str):
  """The weights of the model updates' mean; each algorithm defaults to its
  paper's ([FedAvg]: examples, [SCAFFOLD] and [FedPVR]: uniform)."""
  return setting(paper_default, 'Weights of clients in the mean of the '
                 'model updates: examples processed or uniform.',
                 CLIENT_WEIGHTINGS, default_per_algorithm=True)


@dataclasses.dataclass(frozen=True)
class ServerSettings:
  """An algorithm whose server applies an optimizer to the mean update."""
  server_optimizer: str = server_optimizer()
  server_learning_rate: float = server_learning_rate()

  def __post_init__(self):
    check(self)


@dataclasses.dataclass(frozen=True)
class SgdClientSettings(ServerSettings):
  """... and whose clients take plain SGD steps of rate eta."""
  client_learning_rate: float = client_learning_rate()


@dataclasses.dataclass(frozen=True)
class ClientOptimizerSettings(SgdClientSettings):
  """... or steps of any client optimizer."""
  client_optimizer: str = client_optimizer()


def check(settings) -> None:
  """Validates every field's choices and bounds.

  Called from each settings class's __post_init__; classes add their own
  checks after it.
  """
  for field in dataclasses.fields(settings):
    value = getattr(settings, field.name)
    choices = field.metadata.get('choices')
    if choices is not None and value not in choices:
      raise SettingError(field.name, f'={value!r} is unknown; allowed: '
                         + ', '.join(str(c) for c in choices))
    bound = field.metadata.get('bound')
    if bound == POSITIVE:
      positive(field.name, value, field.metadata.get('role', ''))
    elif bound == NON_NEGATIVE:
      non_negative(field.name, value)


def positive(name: str, value: float, role: str = '') -> None:
  if not (math.isfinite(value) and value > 0):
    role = f' ({role})' if role else ''
    raise SettingError(name, f'must be a finite number > 0{role}, got {value}')


def non_negative(name: str, value: float) -> None:
  if not (math.isfinite(value) and value >= 0):
    raise SettingError(name, f'must be a finite number >= 0, got {value}')


def optimizer(name: str, learning_rate: float
              ) -> tff.learning.optimizers.Optimizer:
  """The `tff.learning.optimizers` optimizer called `name`."""
  builders = {
      'sgd': lambda: tff.learning.optimizers.build_sgdm(learning_rate),
      'sgdm': lambda: tff.learning.optimizers.build_sgdm(
          learning_rate, momentum=0.9),
      'adam': lambda: tff.learning.optimizers.build_adam(learning_rate),
      'yogi': lambda: tff.learning.optimizers.build_yogi(learning_rate),
      'adagrad': lambda: tff.learning.optimizers.build_adagrad(learning_rate),
      'rmsprop': lambda: tff.learning.optimizers.build_rmsprop(learning_rate),
  }
  return builders[name]()


def as_dict(settings) -> dict[str, Any]:
  return dataclasses.asdict(settings)

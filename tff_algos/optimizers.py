"""`tff.learning.optimizers` chosen by name (SGD is the default everywhere)."""

from typing import Callable

import tensorflow_federated as tff

from pipeline.errors import UsageError

_BUILDERS: dict[str, Callable[[float], tff.learning.optimizers.Optimizer]] = {
    'sgd': lambda lr: tff.learning.optimizers.build_sgdm(learning_rate=lr),
    'sgdm': lambda lr: tff.learning.optimizers.build_sgdm(
        learning_rate=lr, momentum=0.9),
    'adam': lambda lr: tff.learning.optimizers.build_adam(learning_rate=lr),
    'yogi': lambda lr: tff.learning.optimizers.build_yogi(learning_rate=lr),
    'adagrad': lambda lr: tff.learning.optimizers.build_adagrad(
        learning_rate=lr),
    'rmsprop': lambda lr: tff.learning.optimizers.build_rmsprop(
        learning_rate=lr),
}
NAMES = tuple(_BUILDERS)


def build(name: str, learning_rate: float,
          flag: str = 'optimizer') -> tff.learning.optimizers.Optimizer:
  if name not in _BUILDERS:
    raise UsageError(
        f'--{flag}={name!r} is unknown; allowed: {", ".join(NAMES)}')
  if not learning_rate > 0:
    raise UsageError(f'learning rate for --{flag}={name} must be > 0, '
                     f'got {learning_rate}')
  return _BUILDERS[name](learning_rate)

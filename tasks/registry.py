"""Task names -> builders."""

from typing import Callable

from pipeline.errors import UsageError
from tasks import base
from tasks import celeba
from tasks import cifar
from tasks import digits
from tasks import emnist
from tasks import fedres_synthetic
from tasks import movielens
from tasks import movielens_ratings
from tasks import stackoverflow_char
from tasks import stackoverflow_word

# name -> (builder, the keys of DataConfig.options it reads)
_TASKS: dict[str, tuple[Callable[[base.DataConfig], base.Task],
                        tuple[str, ...]]] = {
    'celeba_smile': (celeba.build_task, celeba.OPTIONS),
    'cifar10': (cifar.build_cifar10, cifar.OPTIONS),
    'cifar100': (cifar.build_cifar100, cifar.OPTIONS),
    'digits': (digits.build_task, digits.OPTIONS),
    'emnist': (emnist.build_task, emnist.OPTIONS),
    'fedres_toy': (fedres_synthetic.build_toy_task, fedres_synthetic.OPTIONS),
    'fedres_logistic': (fedres_synthetic.build_logistic_task,
                        fedres_synthetic.OPTIONS),
    'movielens': (movielens.build_task, movielens.OPTIONS),
    'movielens_ratings': (movielens_ratings.build_task,
                          movielens_ratings.OPTIONS),
    'stackoverflow_char': (stackoverflow_char.build_task,
                           stackoverflow_char.OPTIONS),
    'stackoverflow_word': (stackoverflow_word.build_task,
                           stackoverflow_word.OPTIONS),
}
NAMES = tuple(_TASKS)


def _check_known(name: str) -> None:
  if name not in _TASKS:
    raise UsageError(f'--task={name!r} is unknown; allowed: {", ".join(NAMES)}')


def options(name: str) -> tuple[str, ...]:
  """The task options (DataConfig.options keys) task `name` reads."""
  _check_known(name)
  return _TASKS[name][1]


def build_task(name: str, config: base.DataConfig) -> base.Task:
  _check_known(name)
  config.validate()
  return _TASKS[name][0](config)

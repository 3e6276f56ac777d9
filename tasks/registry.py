"""Task names -> builders."""

import dataclasses
import sys
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

_BUILDERS: dict[str, Callable[[base.DataConfig], base.Task]] = {
    'celeba_smile': celeba.build_task,
    'cifar10': cifar.build_cifar10,
    'cifar100': cifar.build_cifar100,
    'digits': digits.build_task,
    'emnist': emnist.build_task,
    'fedres_toy': fedres_synthetic.build_toy_task,
    'fedres_logistic': fedres_synthetic.build_logistic_task,
    'movielens': movielens.build_task,
    'movielens_ratings': movielens_ratings.build_task,
    'stackoverflow_char': stackoverflow_char.build_task,
    'stackoverflow_word': stackoverflow_word.build_task,
}
NAMES = tuple(_BUILDERS)


def _builder(name: str) -> Callable[[base.DataConfig], base.Task]:
  if name not in _BUILDERS:
    raise UsageError(f'--task={name!r} is unknown; allowed: {", ".join(NAMES)}')
  return _BUILDERS[name]


def options(name: str) -> tuple[str, ...]:
  """The task options (DataConfig.options keys) task `name` reads: the
  `OPTIONS` of its builder's module."""
  return sys.modules[_builder(name).__module__].OPTIONS


def data_locations(name: str) -> tuple[str, ...]:
  """The data-location flags (--cache_dir, --data_dir, --download) task
  `name` reads: the `DATA_LOCATIONS` of its builder's module, if any (the
  others read no files, or take --movielens_dir as an option)."""
  return getattr(sys.modules[_builder(name).__module__], 'DATA_LOCATIONS', ())


def build_task(name: str, config: base.DataConfig) -> base.Task:
  builder = _builder(name)
  config.validate()
  task = builder(config)
  base.check_batches_fit(task, config)
  return dataclasses.replace(task, data_config=config)

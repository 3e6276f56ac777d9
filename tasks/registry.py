"""Task names -> builders."""

from typing import Callable

from pipeline.errors import UsageError
from tasks import base
from tasks import celeba
from tasks import digits

_BUILDERS: dict[str, Callable[[base.DataConfig], base.Task]] = {
    'celeba_smile': celeba.build_task,
    'digits': digits.build_task,
}
NAMES = tuple(_BUILDERS)


def build_task(name: str, config: base.DataConfig) -> base.Task:
  if name not in _BUILDERS:
    raise UsageError(f'--task={name!r} is unknown; allowed: {", ".join(NAMES)}')
  config.validate()
  return _BUILDERS[name](config)

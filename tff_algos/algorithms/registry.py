"""Algorithm names -> their settings class and round definition.

`build(name, task, settings)` returns the `RoundDefinition` the runtimes run;
`settings_class(name)` the frozen dataclass of its settings (whose fields
are its command-line flags).
"""

import dataclasses
from typing import Any, Callable

from tasks import base
from tff_algos.algorithms import round as round_lib
from tff_algos.algorithms.baselines import definition as baselines
from tff_algos.algorithms.fedres import definition as fedres
from tff_algos.algorithms.mixed import definition as mixed
from tff_algos.algorithms.scaffold import definition as scaffold


@dataclasses.dataclass(frozen=True)
class Entry:
  settings_class: type
  # (task, settings) -> RoundDefinition.
  build: Callable[[base.Task, Any], round_lib.RoundDefinition]
  summary: str


ALGORITHMS: dict[str, Entry] = {
    'fedavg': Entry(baselines.FedAvgSettings,
                    lambda task, s: baselines.fedavg(task.model_fn, s),
                    'FedAvg (tff.learning\'s client update)'),
    'fedprox': Entry(baselines.FedProxSettings,
                     lambda task, s: baselines.fedprox(task.model_fn, s),
                     'FedProx (the paper\'s proximal term)'),
    'fedsgd': Entry(baselines.FedSgdSettings,
                    lambda task, s: baselines.fedsgd(task.model_fn, s),
                    'FedSGD'),
    'scaffold': Entry(scaffold.ScaffoldSettings, scaffold.scaffold,
                      'SCAFFOLD (control variates on every variable)'),
    'fedpvr': Entry(scaffold.FedPvrSettings, scaffold.fedpvr,
                    'FedPVR (control variates on the last layers)'),
    **{name: Entry(mixed.SETTINGS[name],
                   lambda task, s, name=name: mixed.definition(name, task, s),
                   summary)
       for name, summary in (
           (mixed.PARALLEL_TRAINING, 'Mixed FL: Parallel Training'),
           (mixed.ONE_WAY_GT, 'Mixed FL: 1-way Gradient Transfer'),
           (mixed.TWO_WAY_GT, 'Mixed FL: 2-way Gradient Transfer'))},
    'fedres_naive': Entry(fedres.FedResSettings, fedres.fedres_naive,
                          'FedResNaive'),
    'fedres_sgd': Entry(fedres.FedResSettings, fedres.fedres_sgd,
                        'FedResSGD'),
    'fedres_avg': Entry(fedres.FedResAvgSettings, fedres.fedres_avg,
                        'FedResAvg (Option I or II)'),
}
NAMES = tuple(ALGORITHMS)


def entry(name: str) -> Entry:
  if name not in ALGORITHMS:
    raise ValueError(
        f'algorithm {name!r} is unknown; allowed: {", ".join(NAMES)}')
  return ALGORITHMS[name]


def settings_class(name: str) -> type:
  return entry(name).settings_class


def build(name: str, task: base.Task,
          settings: Any = None) -> round_lib.RoundDefinition:
  """The round of algorithm `name` on `task` (default settings if None)."""
  found = entry(name)
  if settings is None:
    settings = found.settings_class()
  if not isinstance(settings, found.settings_class):
    raise TypeError(f'{name} takes {found.settings_class.__name__}, got '
                    f'{type(settings).__name__}')
  return found.build(task, settings)

"""Algorithm names -> builders `(model_fn, AlgorithmConfig) -> FederatedAlgorithm`.

Builders that need more of the task than its `model_fn` (FedRes needs the
task's residual model and per-client evaluation data) take the task instead:
`(task, AlgorithmConfig) -> FederatedAlgorithm`.
"""

from typing import Callable, Optional

from pipeline.errors import UsageError
from tasks import base
from tff_algos import baselines
from tff_algos import contract
from tff_algos import scaffold_tff
from tff_algos import mixed_tff
from tff_algos import fedres_tff
from tff_algos.config import AlgorithmConfig

Builder = Callable[[Callable, AlgorithmConfig], contract.FederatedAlgorithm]
TaskBuilder = Callable[[base.Task, AlgorithmConfig],
                       contract.FederatedAlgorithm]

_BUILDERS: dict[str, Builder] = {
    'fedavg': baselines.build_fedavg,
    'fedprox': baselines.build_fedprox,
    'fedsgd': baselines.build_fedsgd,
    'scaffold': scaffold_tff.build_scaffold,
    'fedpvr': scaffold_tff.build_fedpvr,
    'mixed_pt': mixed_tff.build_mixed_pt,
    'mixed_1wgt': mixed_tff.build_mixed_1wgt,
    'mixed_2wgt': mixed_tff.build_mixed_2wgt,
}
_TASK_BUILDERS: dict[str, TaskBuilder] = {
    'fedres_naive': fedres_tff.build_fedres_naive,
    'fedres_sgd': fedres_tff.build_fedres_sgd,
    'fedres_avg': fedres_tff.build_fedres_avg,
}
NAMES = tuple(_BUILDERS) + tuple(_TASK_BUILDERS)


def build_algorithm(name: str, model_fn: Callable, config: AlgorithmConfig,
                    task: Optional[base.Task] = None
                    ) -> contract.FederatedAlgorithm:
  if name not in NAMES:
    raise UsageError(
        f'--algorithm={name!r} is unknown; allowed: {", ".join(NAMES)}')
  if config.proximal_strength < 0:
    raise UsageError('--proximal_strength must be >= 0, got '
                     f'{config.proximal_strength}')
  if name in _TASK_BUILDERS:
    if task is None:
      raise ValueError(f'{name} is built from the task: pass task=')
    return _TASK_BUILDERS[name](task, config)
  return _BUILDERS[name](model_fn, config)

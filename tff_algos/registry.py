"""Algorithm names -> builders `(model_fn, AlgorithmConfig) -> FederatedAlgorithm`."""

from typing import Callable

from pipeline.errors import UsageError
from tff_algos import baselines
from tff_algos import contract
from tff_algos import scaffold_tff
from tff_algos import mixed_tff
from tff_algos.config import AlgorithmConfig

Builder = Callable[[Callable, AlgorithmConfig], contract.FederatedAlgorithm]

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
NAMES = tuple(_BUILDERS)
# Every algorithm named by SPEC 7; those not in _BUILDERS are not built yet.
SPEC_NAMES = ('fedavg', 'fedprox', 'fedsgd', 'mixed_pt', 'mixed_1wgt',
              'mixed_2wgt', 'scaffold', 'fedpvr', 'fedres_naive', 'fedres_sgd',
              'fedres_avg')


def build_algorithm(name: str, model_fn: Callable,
                    config: AlgorithmConfig) -> contract.FederatedAlgorithm:
  if name not in _BUILDERS:
    raise UsageError(
        f'--algorithm={name!r} is unknown; allowed: {", ".join(NAMES)}')
  if config.proximal_strength < 0:
    raise UsageError('--proximal_strength must be >= 0, got '
                     f'{config.proximal_strength}')
  return _BUILDERS[name](model_fn, config)

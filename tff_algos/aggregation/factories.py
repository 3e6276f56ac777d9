"""The model-update aggregator of a run: a `tff.aggregators` factory.

`--aggregator` names one of tff.learning's model-update aggregators
(`tff.learning.robust_aggregator`, `dp_aggregator`, `compression_aggregator`,
`secure_aggregator`), built here from the same `tff.aggregators` parts with
their parameters as settings:

  mean         the weighted mean (the default; no factory: the runtimes'
               own mean over groups of clients, as before)
  robust       the weighted mean after L2 clipping and zeroing
  dp           Gaussian DP mean (fixed L2 clip, seeded noise; unweighted, as
               every tff.aggregators DP mean), without zeroing
  compression  the weighted mean of uniformly quantized updates (tensors
               above COMPRESSION_THRESHOLD elements; seeded rounding), after
               clipping and zeroing
  secure       the weighted mean by secure summation, after clipping and
               zeroing

Clipping (`clip_norm`): unset, tff.learning's adaptive norm (a quantile
estimate of the clients' norms without noise); a number, that fixed norm;
inf, no clipping. Zeroing (`zeroing`): unset, tff.learning's default (on).
dp has none (tff.learning's dp_aggregator offers it): its adaptive threshold
is estimated from the clients' norms without noise, outside the DP
guarantee, so the epsilon a run logs would not hold.

DP's clip is fixed because its noise must be seeded for exact resumes
(`seeded_gaussian`); TFF's adaptive DP clipping draws unseeded noise. For the
same reason compression's stochastic rounding is seeded
(`seeded_quantization`): TFF's `EncodedSumFactory` rounds with unseeded
random numbers, so runs with the same flags differed.
"""

import dataclasses
import math
from typing import Optional

import tensorflow_federated as tff
import tensorflow_privacy as tfp

from tff_algos.aggregation import seeded_gaussian
from tff_algos.aggregation import seeded_quantization
from tff_algos.algorithms import settings as settings_lib

# Tensors of more elements are quantized (tff.learning's compression_aggregator).
COMPRESSION_THRESHOLD = 20000
MEAN = 'mean'
ROBUST = 'robust'
DP = 'dp'
COMPRESSION = 'compression'
SECURE = 'secure'
NAMES = (MEAN, ROBUST, DP, COMPRESSION, SECURE)
_MAX_FLOAT32 = 3.4028234663852886e38

# The settings each aggregator reads (besides `aggregator`).
FIELDS = {
    MEAN: (),
    ROBUST: ('clip_norm', 'zeroing'),
    # No zeroing: its threshold is estimated from the clients' update norms
    # without noise, outside the DP guarantee.
    DP: ('clip_norm', 'dp_noise_multiplier', 'dp_clients_per_round',
         'dp_target_delta'),
    COMPRESSION: ('clip_norm', 'zeroing', 'compression_bits'),
    SECURE: ('clip_norm', 'zeroing'),
}


@dataclasses.dataclass(frozen=True)
class AggregatorSettings:
  """How the clients' model updates are aggregated (module docstring)."""
  aggregator: str = MEAN
  clip_norm: Optional[float] = None
  zeroing: Optional[bool] = None
  dp_noise_multiplier: Optional[float] = None
  # Denominator of the DP mean (TFF's expected clients per round).
  dp_clients_per_round: Optional[int] = None
  dp_target_delta: Optional[float] = None
  compression_bits: int = 8
  # Seed of the DP noise and of compression's stochastic rounding.
  noise_seed: int = 0

  def __post_init__(self):
    if self.aggregator not in NAMES:
      raise settings_lib.SettingError(
          'aggregator', f'={self.aggregator!r} is unknown; allowed: '
          + ', '.join(NAMES))
    if self.clip_norm is not None and not (
        self.clip_norm > 0):  # inf allowed: no clipping.
      raise settings_lib.SettingError(
          'clip_norm', f'must be > 0 (inf: no clipping), got {self.clip_norm}')
    if self.aggregator == DP:
      if self.zeroing:
        raise settings_lib.SettingError(
            'zeroing', 'does not apply to --aggregator=dp: its threshold is '
            'estimated from the clients\' update norms without noise, so '
            'the DP guarantee (and the logged epsilon) would not hold')
      if self.dp_noise_multiplier is None:
        raise settings_lib.SettingError(
            'dp_noise_multiplier', 'is needed by --aggregator=dp')
      settings_lib.non_negative('dp_noise_multiplier',
                                self.dp_noise_multiplier)
      if self.clip_norm is None or math.isinf(self.clip_norm):
        raise settings_lib.SettingError(
            'clip_norm', 'must be a finite number > 0 with --aggregator=dp '
            '(the L2 bound of a client\'s update the noise is scaled to)')
      # The noise's stddev is a float32 of the computation: beyond its
      # range it is inf, and every update NaN.
      stddev = self.clip_norm * self.dp_noise_multiplier
      if stddev > _MAX_FLOAT32:
        raise settings_lib.SettingError(
            'dp_noise_multiplier',
            f'times --clip_norm is the noise\'s stddev, {stddev:g}: at most '
            f'{_MAX_FLOAT32:.8g} (a float32)')
      if self.dp_clients_per_round is not None and (
          self.dp_clients_per_round < 1):
        raise settings_lib.SettingError(
            'dp_clients_per_round',
            f'must be >= 1, got {self.dp_clients_per_round}')
      if self.dp_target_delta is not None and not (
          0 < self.dp_target_delta < 1):
        raise settings_lib.SettingError(
            'dp_target_delta',
            f'must be in (0, 1), got {self.dp_target_delta}')
    if self.aggregator == COMPRESSION and not 1 <= self.compression_bits <= 16:
      raise settings_lib.SettingError(
          'compression_bits', f'must be in 1..16, got {self.compression_bits}')

  @property
  def uses_zeroing(self) -> bool:
    if self.aggregator == DP:
      return False
    return True if self.zeroing is None else self.zeroing


def build(settings: AggregatorSettings, clients_per_round: int
          ) -> Optional[tff.aggregators.AggregationFactory]:
  """The factory of `settings`; None for the mean (the runtimes' own).

  `clients_per_round` is the DP mean's denominator unless
  `settings.dp_clients_per_round` is set.
  """
  name = settings.aggregator
  if name == MEAN:
    return None
  secure = name == SECURE
  if name == DP:
    clip = settings.clip_norm
    query = tfp.NormalizedQuery(
        seeded_gaussian.SeededGaussianSumQuery(
            clip, clip * settings.dp_noise_multiplier, settings.noise_seed),
        denominator=float(settings.dp_clients_per_round or clients_per_round))
    aggregator = tff.aggregators.DifferentiallyPrivateFactory(query)
  else:
    if name == COMPRESSION:
      aggregator = tff.aggregators.MeanFactory(
          seeded_quantization.SeededQuantizedSumFactory(
              settings.compression_bits, COMPRESSION_THRESHOLD,
              settings.noise_seed))
    elif secure:
      aggregator = _secure_mean()
    else:
      aggregator = tff.aggregators.MeanFactory()
    aggregator = _clipped(aggregator, settings.clip_norm, secure)
  if settings.uses_zeroing:
    aggregator = _zeroed(aggregator, secure)
  return aggregator


def _secure_count():
  return tff.aggregators.SecureSumFactory(upper_bound_threshold=1,
                                          lower_bound_threshold=0)


def _secure_mean():
  # As tff.learning.secure_aggregator's weighted mean.
  bound = tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
      initial_estimate=50.0, target_quantile=0.95, learning_rate=1.0,
      multiplier=2.0, secure_estimation=True)
  return tff.aggregators.MeanFactory(
      value_sum_factory=tff.aggregators.SecureSumFactory(bound),
      weight_sum_factory=tff.aggregators.SecureSumFactory(
          upper_bound_threshold=float(2**20 - 1), lower_bound_threshold=0.0))


def _clipped(inner, clip_norm: Optional[float], secure: bool):
  if clip_norm is not None and math.isinf(clip_norm):
    return inner
  if clip_norm is None:
    # tff.learning's adaptive clipping norm.
    clip_norm = tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
        initial_estimate=1.0, target_quantile=0.8, learning_rate=0.2,
        secure_estimation=secure)
  if secure:
    return tff.aggregators.clipping_factory(
        clip_norm, inner, clipped_count_sum_factory=_secure_count())
  return tff.aggregators.clipping_factory(clip_norm, inner)


def _zeroed(inner, secure: bool):
  # tff.learning's adaptive zeroing: a norm somewhat above the largest seen.
  zeroing_norm = tff.aggregators.PrivateQuantileEstimationProcess.no_noise(
      initial_estimate=10.0, target_quantile=0.98, learning_rate=math.log(10.0),
      multiplier=2.0, increment=1.0, secure_estimation=secure)
  if secure:
    return tff.aggregators.zeroing_factory(
        zeroing_norm, inner, zeroed_count_sum_factory=_secure_count())
  return tff.aggregators.zeroing_factory(zeroing_norm, inner)

"""Privacy spent by the DP aggregator, from `dp_accounting`.

The driver samples a round's cohort uniformly WITHOUT replacement, a fixed
`clients_per_round` of the `population`, so the accountant is dp_accounting's
RDP accountant for sampling without replacement, under its neighbouring
relation REPLACE_ONE (one client's data replaced by another's). Replacing a
client moves the clipped sum by up to 2 * clip, so the Gaussian event of a
round has noise multiplier z / 2 relative to that sensitivity, where z is
the noise stddev over the clip (`--dp_noise_multiplier`).

Epsilon is client-level (a client's whole data) and covers what goes through
the DP aggregator only (docs/aggregators.md: per algorithm).
"""

import dataclasses
import functools
from typing import Optional

import dp_accounting
import numpy as np

# The metric of the privacy spent so far, logged every round.
EPSILON_METRIC = 'privacy/epsilon'


@dataclasses.dataclass(frozen=True)
class DpAccounting:
  noise_multiplier: float
  population: int
  clients_per_round: int
  target_delta: float

  def round_event(self) -> dp_accounting.DpEvent:
    """One round's release as a DP event."""
    return dp_accounting.SampledWithoutReplacementDpEvent(
        source_dataset_size=self.population,
        sample_size=self.clients_per_round,
        event=dp_accounting.GaussianDpEvent(self.noise_multiplier / 2))

  @functools.cached_property
  def _one_round(self) -> dp_accounting.rdp.RdpAccountant:
    # The RDP of a round takes about a second to compute; rounds compose
    # by adding it.
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    # With much noise the RDP terms underflow: log(0) is the accountant's
    # own -inf, and its epsilon 0 is right; numpy's warning is not a
    # problem of the run.
    with np.errstate(divide='ignore'):
      accountant.compose(self.round_event())
    return accountant

  def epsilon(self, rounds: int) -> float:
    """Epsilon at `target_delta` after `rounds` rounds (inf without noise)."""
    if self.noise_multiplier == 0:
      return float('inf')
    one_round = self._one_round
    with np.errstate(divide='ignore'):
      epsilon, _ = dp_accounting.rdp.compute_epsilon(
          one_round.orders, rounds * one_round.rdp, self.target_delta)
    # Past float32's range (noise near 0) it is no guarantee, and logged as a
    # float32 metric it would fail TensorBoard's scalar write: inf, as
    # without noise.
    if not epsilon <= np.finfo(np.float32).max:
      return float('inf')
    return float(epsilon)


def default_delta(population: int) -> float:
  return 1.0 / population


def accounting(noise_multiplier: float, population: int,
               clients_per_round: int,
               target_delta: Optional[float] = None) -> DpAccounting:
  return DpAccounting(noise_multiplier, population, clients_per_round,
                      target_delta or default_delta(population))

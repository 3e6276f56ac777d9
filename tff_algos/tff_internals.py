"""Every use of TFF's non-public modules, in one place, for one TFF version.

The project pins tensorflow-federated 0.87.0. These parts of it are not in
its public API (`tff.*`) but are used here:

- tff.learning's own client updates and its finalizer's rejection rule, so
  FedAvg and FedSGD run exactly tff.learning's math inside this project's
  rounds (clients by id, groups);
- the mergeable execution context's two partitioning bugs, patched
  (`fix_mergeable_context_partitioning`);
- the execution-context plumbing for already-running remote workers and the
  default context's reset (`pipeline.tff_runtime`).

Importing this module checks the version, so an upgrade fails here, loudly,
rather than somewhere inside a round.
"""

import tensorflow_federated as tff

SUPPORTED_VERSION = '0.87.0'
if tff.__version__ != SUPPORTED_VERSION:
  raise ImportError(
      f'tff_algos uses private parts of tensorflow-federated '
      f'{SUPPORTED_VERSION} (tff_algos/tff_internals.py); found '
      f'{tff.__version__}')

# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
from tensorflow_federated.python.learning.algorithms import fed_sgd
from tensorflow_federated.python.learning.templates import apply_optimizer_finalizer
from tensorflow_federated.python.learning.templates import model_delta_client_work
# pylint: enable=g-import-not-at-top,g-bad-import-order,wrong-import-position

# FedAvg's client update: (optimizer, initial_weights, data[, hparams]) ->
# (ClientResult(update = x - y, update_weight), unfinalized metrics).
build_model_delta_update = (
    model_delta_client_work.build_model_delta_update_with_tff_optimizer)


def build_fed_sgd_client_update(model, loop_implementation):
  """FedSGD's client update: (initial_weights, data) -> (ClientResult(
  update = example-weighted mean gradient, update_weight), metrics)."""
  return fed_sgd._build_client_update(  # pylint: disable=protected-access
      model, loop_implementation=loop_implementation)


# (optimizer_state, update) -> (reject?, measurements): tff.learning's
# finalizer rejects a non-finite update, keeping weights and state.
reject_non_finite_update = apply_optimizer_finalizer.reject_non_finite_update

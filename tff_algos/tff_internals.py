"""Every use of TFF's non-public modules, in one place, for one TFF version.

The project pins tensorflow-federated 0.87.0. These parts of it are not in
its public API (`tff.*`) but are used here:

- tff.learning's rules for non-finite values (a client's non-finite update
  is zeroed with weight 0; the finalizer rejects a non-finite mean update),
  so FedAvg and FedSGD compute exactly what tff.learning computes;
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
from tensorflow_federated.python.learning import tensor_utils
from tensorflow_federated.python.learning.templates import apply_optimizer_finalizer
# pylint: enable=g-import-not-at-top,g-bad-import-order,wrong-import-position

# structure -> (structure with every value zeroed if any is not finite,
# 1 if it was so else 0): what tff.learning's client updates apply.
zero_all_if_any_non_finite = tensor_utils.zero_all_if_any_non_finite


# (optimizer_state, update) -> (reject?, measurements): tff.learning's
# finalizer rejects a non-finite update, keeping weights and state.
reject_non_finite_update = apply_optimizer_finalizer.reject_non_finite_update

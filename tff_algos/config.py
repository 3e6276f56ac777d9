"""Hyperparameters of every algorithm, filled from the command line."""

import dataclasses
from typing import Any, Callable, Optional

# How server means weight clients: by examples processed or equally.
CLIENT_WEIGHTINGS = ('num_examples', 'uniform')


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
  client_optimizer: str = 'sgd'
  client_learning_rate: float = 0.01
  server_optimizer: str = 'sgd'
  server_learning_rate: float = 1.0
  proximal_strength: float = 0.01
  # FedResAvg: 1 (no control variates) or 2 (SCAFFOLD-style c, c_i).
  fedres_option: int = 2
  # FedRes: lambda, the SGD learning rate of the local models theta_i.
  local_learning_rate: float = 0.01
  # FedResAvg: alpha, the server step on the mean client delta.
  fedres_alpha: float = 1.0
  # FedRes personalized evaluation: fit the local model of a client that has
  # never been sampled (Step 1 on its K train batches) instead of using the
  # initial theta.
  fedres_fit_unseen: bool = False
  # Size N of the train population (SCAFFOLD's |S|/N rule).
  num_train_clients: int = 1
  clients_per_round: int = 1
  # Client weights p_i in server means: 'num_examples' (processed) or
  # 'uniform'.
  client_weighting: str = 'num_examples'
  # SCAFFOLD / FedPVR.
  scaffold_option: int = 2
  pvr_last_layers: int = 1
  # When set, FedPVR masks trainable variables from this index on instead.
  pvr_start_variable: Optional[int] = None
  drift_diversity: bool = False
  # Mixed FL ([MixedFL]).
  central_optimizer: str = 'sgd'
  central_learning_rate: float = 0.01
  merge_optimizer: str = 'sgd'
  merge_learning_rate: float = 1.0
  federated_weight: float = 0.5
  central_weight: float = 0.5
  mixed_diagnostics: bool = False
  # K central steps per round (PT, 2-w GT); None when K is not set.
  central_steps: Optional[int] = None
  # A data-free centralized loss supplied by the task (model weights ->
  # scalar), e.g. an embedding regularizer; None: the loss on server batches.
  central_loss_fn: Optional[Callable[[Any], Any]] = None

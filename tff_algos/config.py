"""Hyperparameters of every algorithm, filled from the command line."""

import dataclasses


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

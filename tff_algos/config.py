"""Hyperparameters of every algorithm, filled from the command line."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
  client_optimizer: str = 'sgd'
  client_learning_rate: float = 0.01
  server_optimizer: str = 'sgd'
  server_learning_rate: float = 1.0
  proximal_strength: float = 0.01
  # Size N of the train population (SCAFFOLD's |S|/N rule).
  num_train_clients: int = 1
  clients_per_round: int = 1

"""Dirichlet(alpha) label partition of a pooled dataset (FedDF, Lin et al. 2020).

The procedure FedPVR ([FedPVR]) takes from the FedDF code: shuffle the
examples once; for every class draw client proportions ~ Dir(alpha * 1_N),
zero the share of any client that already holds at least n/N examples,
renormalize and deal the class's examples by the cumulative proportions;
redraw everything until the smallest client holds at least half the average.
Small alpha gives clients dominated by one or two classes; large alpha
approaches an i.i.d. split. Client sizes are only roughly balanced.

FedDF applies this to blocks of 10 clients at a time when N > 10; here the
whole population is one block (identical for the paper's N = 10).
"""

import numpy as np

# Redraws allowed before giving up (a tiny dataset with a tiny alpha may never
# satisfy the minimum size).
MAX_DRAWS = 1000
# Smallest client must hold at least this fraction of n / N examples.
MIN_SIZE_FRACTION = 0.5


class PartitionError(ValueError):
  """No partition meeting the minimum client size was found."""


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float,
                        seed: int) -> list[np.ndarray]:
  """Indices into `labels` for each of `num_clients` clients.

  Every example goes to exactly one client. Deterministic in `seed`: it draws
  from `np.random.RandomState(seed)` in the same order as the FedDF code, so
  the same seed gives FedDF's partition (when every class 0..C-1 occurs; FedDF
  also draws proportions for absent classes).

  Raises:
    ValueError: for num_clients < 1, alpha <= 0 or fewer examples than clients.
    PartitionError: no draw met the minimum client size in MAX_DRAWS tries.
  """
  labels = np.asarray(labels)
  if labels.ndim != 1:
    raise ValueError(f'labels must be 1-D, got shape {labels.shape}')
  if num_clients < 1:
    raise ValueError(f'num_clients must be >= 1, got {num_clients}')
  if not alpha > 0:
    raise ValueError(f'alpha must be > 0, got {alpha}')
  num_examples = len(labels)
  if num_examples < num_clients:
    raise ValueError(f'{num_examples} examples cannot fill {num_clients} '
                     'clients')
  random_state = np.random.RandomState(seed)
  # (index, label) pairs in one shuffled order, as FedDF shuffles them.
  pairs = np.stack([np.arange(num_examples), labels], axis=1)
  random_state.shuffle(pairs)
  classes = np.unique(labels)
  capacity = num_examples / num_clients
  min_size = int(MIN_SIZE_FRACTION * num_examples / num_clients)
  for _ in range(MAX_DRAWS):
    clients = [[] for _ in range(num_clients)]
    for label in classes:
      class_indices = pairs[pairs[:, 1] == label, 0]
      proportions = random_state.dirichlet(np.repeat(alpha, num_clients))
      not_full = np.array([len(c) < capacity for c in clients])
      proportions = proportions * not_full
      # Every client with weight is full, or the draw underflowed to NaN
      # (alpha near 0): redraw.
      if not proportions.sum() > 0:
        break
      proportions /= proportions.sum()
      cuts = (np.cumsum(proportions) * len(class_indices)).astype(int)[:-1]
      for client, part in zip(clients, np.split(class_indices, cuts)):
        client.extend(part.tolist())
    else:
      if min(len(c) for c in clients) >= min_size:
        return [np.asarray(c, dtype=np.int64) for c in clients]
  raise PartitionError(
      f'no Dirichlet(alpha={alpha}) partition of {num_examples} examples over '
      f'{num_clients} clients gave every client >= {min_size} examples in '
      f'{MAX_DRAWS} draws')

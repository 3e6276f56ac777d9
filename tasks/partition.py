"""Splitting a centralized labelled dataset into federated clients.

`similarity_partition` is SCAFFOLD's "s% similarity" split ([SCAFFOLD]
Sec. 7.1, after Hsu et al. 2019): every client gets the same number of
examples, an s% share of them drawn i.i.d. from the whole dataset and the rest
a contiguous shard of the remaining examples sorted by label. s = 0 gives each
client one or two labels; s = 100 is i.i.d.
"""

import numpy as np

from pipeline.errors import UsageError


def similarity_partition(labels: np.ndarray, num_clients: int,
                         similarity: float, seed: int) -> list[np.ndarray]:
  """Example indices of each client under an s% similarity split.

  Args:
    labels: integer label of every example, shape [n].
    num_clients: N, the number of clients (`--num_clients`).
    similarity: s in [0, 100], the percentage of each client's examples drawn
      i.i.d. (`--similarity`).
    seed: seeds which examples are i.i.d. and how ties are ordered.

  Returns:
    `num_clients` disjoint int64 index arrays of equal size floor(n / N). The
    n mod N examples left over are dropped (chosen at random), so client sizes
    stay equal. Within a client, the i.i.d. indices come first, then the
    label-sorted shard. Client k's shard is the k-th in label order.

  Raises:
    UsageError: N < 1, N > n, or s outside [0, 100].
  """
  labels = np.asarray(labels)
  if labels.ndim != 1:
    raise ValueError(f'labels must be one-dimensional, got shape {labels.shape}')
  num_examples = labels.shape[0]
  if num_examples == 0:
    raise UsageError('the task\'s data hold no training examples to deal to '
                     f'--num_clients={num_clients} clients')
  if not 1 <= num_clients <= num_examples:
    raise UsageError(f'--num_clients={num_clients} is impossible for '
                     f'{num_examples} examples (allowed: 1..{num_examples})')
  if not 0.0 <= similarity <= 100.0:
    raise UsageError(f'--similarity={similarity} must be a percentage in '
                     '[0, 100]')
  client_size = num_examples // num_clients
  iid_per_client = int(round(client_size * similarity / 100.0))
  sorted_per_client = client_size - iid_per_client

  rng = np.random.default_rng(seed)
  used = rng.permutation(num_examples)[:client_size * num_clients]
  iid_part = used[:iid_per_client * num_clients]
  rest = used[iid_per_client * num_clients:]
  # A stable sort keeps the random order among equal labels, so which example
  # of a label lands in which shard is random too.
  rest = rest[np.argsort(labels[rest], kind='stable')]

  clients = []
  for k in range(num_clients):
    iid = iid_part[k * iid_per_client:(k + 1) * iid_per_client]
    shard = rest[k * sorted_per_client:(k + 1) * sorted_per_client]
    clients.append(np.concatenate([iid, shard]).astype(np.int64))
  return clients

"""movielens: next-movie prediction with a dual encoder ([MixedFL] Sec. 5.3).

[MixedFL] Sec. 5.3, App. C.2.3 and C.3 (the model follows Ning et al.
2021, which the paper cites):
- Each MovieLens user is a client. A user's ratings in time order (ties broken
  by movie id) m_1..m_T give T-1 examples: context = the bag of the (at most
  `context_length`) movies before m_t, label = m_t.
- Users are split once, seeded: 20% of them give the server (datacenter) data,
  the rest are split 80/10/10 into train clients, validation users and test
  users (ML-1M: 3,866 / 483 / 483; the paper's 3,865 train users imply one
  more server user than 20% rounds to).
- Dual encoder with ONE movie embedding table shared by both towers: the
  context tower averages the context movies' embeddings (a bag of movies) and
  applies a d x d dense layer; the label tower is the embedding lookup of a
  movie. Similarity is the cosine. The model scores a context against every
  movie (its output is [batch, num_rows]; column 0 is the padding id, scored
  below any movie), so the same model serves recall@10 and recommendations.
- Federated loss: the hinge loss on the positive pair only,
  max(0, margin - cos(context, label))^2 (Ning et al.'s squared hinge, margin
  0.9). It needs only the embedding rows of the client's own movies.
- Spreadout regularizer (Zhang et al. 2017) over the full table of movie
  embeddings: || offdiag(E E^T) ||_F with rows l2-normalized. It is the
  data-free central loss of the mixed algorithms (`Task.central_loss_fn`), or,
  with the `spreadout_on_clients` option (the baseline), part of every
  client's loss with weight `spreadout_weight`.
- Metric: recall@10 against all movies (`SparseTopKCategoricalAccuracy`, k=10)
  on the test users (`eval/recall_at_10`) and validation users
  (`eval_val/recall_at_10`).

The server data (examples of the 20% server users, shuffled) are exposed as
`server_dataset_computation` (the task's central data); the paper's mixed FL here uses
only the data-free spreadout loss at the server (Table 2: no centralized
data), so the mixed algorithms do not read them.

Per-round client costs (`client_cost_fn`, see `tff_algos.runtime.communication`):
analytic, from the batches each sampled client trains on. With
d = embedding dim, b = a batch's size, c = its non-padding context ids,
N = number of movies, per client step (the counting of [MixedFL] App. C.3):
  c*d (bag of movies) + 3*b*d^2 (dense layer, forward + backward)
  + 3*b^2*d (similarities, forward + backward) + 2*b (hinge)
  [+ N^2*d/2 + N*d (spreadout and its gradient) with spreadout on clients]
summed over the client's steps of the round. One copy of the model as a
client needs it: the n_i embedding rows its batches touch (context and label
ids) plus the dense layer (d*d + d), or the full table when the client
computes the spreadout.

Reads ML-1M `ratings.dat` or ML-100K `u.data` from `--movielens_dir`
(`tasks.movielens_files`); nothing is downloaded.
"""

import collections

import numpy as np
import tensorflow as tf

from pipeline.errors import UsageError
from tasks import base
from tasks import client_arrays
from tasks import movielens_files

# Keys of `DataConfig.options` this task reads (registry.options).
OPTIONS = ('movielens_dir', 'movielens_embedding_dim',
           'movielens_context_length', 'spreadout_on_clients',
           'spreadout_weight')

PAD_ID = 0
EMBEDDING_DIM = 16
CONTEXT_LENGTH = 10
HINGE_MARGIN = 0.9
RECALL_K = 10
SERVER_USER_FRACTION = 0.2
# Of the users left after the server's: validation and test fractions.
VAL_FRACTION = 0.1
TEST_FRACTION = 0.1
EMBEDDING_LAYER = 'movie_embeddings'

SYNTHETIC_USERS = 60
SYNTHETIC_MOVIES = 40
SYNTHETIC_GENRES = 4


def synthetic_ratings(seed: int) -> dict[str, np.ndarray]:
  """Small ratings with the structure of the real files.

  Movies belong to genres; each user mostly watches one genre, so the next
  movie is predictable from the context.
  """
  rng = np.random.default_rng([seed, 6])
  movie_genre = np.arange(SYNTHETIC_MOVIES) % SYNTHETIC_GENRES
  columns = collections.defaultdict(list)
  for user in range(1, SYNTHETIC_USERS + 1):
    favourite = rng.integers(SYNTHETIC_GENRES)
    preference = np.where(movie_genre == favourite, 8.0, 1.0)
    count = rng.integers(4, 25)
    movies = rng.choice(np.arange(1, SYNTHETIC_MOVIES + 1), size=count,
                        replace=False, p=preference / preference.sum())
    columns['user'].append(np.full(count, user))
    columns['movie'].append(movies)
    columns['rating'].append(rng.integers(1, 6, count).astype(np.float32))
    columns['timestamp'].append(np.sort(rng.integers(9.5e8, 9.6e8, count)))
  return {k: np.concatenate(v) for k, v in columns.items()}


def load_ratings(config: base.DataConfig) -> dict[str, np.ndarray]:
  if config.use_synthetic_data:
    return synthetic_ratings(config.seed)
  movielens_dir = config.options.get('movielens_dir')
  if not movielens_dir:
    raise UsageError('--movielens_dir is required for --task=movielens (a '
                     'directory with MovieLens 1M ratings.dat or MovieLens '
                     '100K u.data), or pass --use_synthetic_data')
  ratings = movielens_files.read_ratings(
      movielens_files.find_ratings(movielens_dir))
  if ratings['movie'].min() < 1 or ratings['user'].min() < 0:
    raise UsageError(f'{movielens_dir}: movie ids must be >= 1 and user ids '
                     '>= 0')
  return ratings


def split_users(users: np.ndarray, seed: int) -> dict[str, np.ndarray]:
  """Seeded user split: server (20%), then train / val / test (80/10/10)."""
  users = np.unique(users)
  np.random.default_rng([seed, 20]).shuffle(users)
  num_server = int(round(SERVER_USER_FRACTION * len(users)))
  server, rest = users[:num_server], users[num_server:]
  num_val = int(round(VAL_FRACTION * len(rest)))
  num_test = int(round(TEST_FRACTION * len(rest)))
  num_train = len(rest) - num_val - num_test
  return {'server': server, 'train': rest[:num_train],
          'val': rest[num_train:num_train + num_val],
          'test': rest[num_train + num_val:]}


def timelines(ratings: dict[str, np.ndarray],
              users: np.ndarray) -> client_arrays.ClientArrays:
  """The movies of `users`, per user in time order (ties: by movie id)."""
  keep = np.isin(ratings['user'], users)
  user, movie = ratings['user'][keep], ratings['movie'][keep]
  order = np.lexsort((movie, ratings['timestamp'][keep], user))
  # ClientArrays groups by user with a stable sort: time order is kept.
  return client_arrays.ClientArrays(
      user[order], {'movie': movie[order].astype(np.int32)})


def timeline_examples(timeline: tf.Tensor, context_length: int):
  """(context [T-1, L], label [T-1]) of one user's timeline [T].

  Example t has label m_t and context m_{t-L}..m_{t-1}, padded with PAD_ID
  in front; the first movie has no history and gives no example.
  """
  padded = tf.concat([tf.fill([context_length], PAD_ID), timeline], 0)
  windows = tf.signal.frame(padded, context_length + 1, 1)[1:]
  return windows[:, :context_length], windows[:, context_length]


def user_examples(arrays: client_arrays.ClientArrays, client_id: tf.Tensor,
                  context_length: int) -> tf.data.Dataset:
  context, label = timeline_examples(arrays.graph_columns(client_id)['movie'],
                                     context_length)
  return tf.data.Dataset.from_tensor_slices((context, label))


def pooled_examples(arrays: client_arrays.ClientArrays,
                    context_length: int) -> tf.data.Dataset:
  """Every example of every user of `arrays`, user by user."""
  return tf.data.Dataset.from_tensor_slices(list(arrays.client_ids)).flat_map(
      lambda client_id: user_examples(arrays, client_id, context_length))


def _to_batch(context, label):
  return context, tf.expand_dims(label, -1)


# --- Losses and model --------------------------------------------------------


def spreadout(table: tf.Tensor) -> tf.Tensor:
  """|| offdiag(E E^T) ||_F of the l2-normalized movie rows (not PAD_ID's)."""
  movies = tf.math.l2_normalize(table[PAD_ID + 1:], axis=-1)
  similarities = tf.matmul(movies, movies, transpose_b=True)
  off_diagonal = tf.linalg.set_diag(
      similarities, tf.zeros(tf.shape(similarities)[:1], similarities.dtype))
  return tf.norm(off_diagonal)


class SpreadoutRegularizer(tf.keras.regularizers.Regularizer):
  """`weight * spreadout(table)`: the baseline's spreadout on clients."""

  def __init__(self, weight: float):
    self.weight = weight

  def __call__(self, table):
    return self.weight * spreadout(table)

  def get_config(self):
    return {'weight': self.weight}


class PositiveHinge(tf.keras.losses.Loss):
  """max(0, margin - cos(context, label))^2, on the positive pair only.

  Keras' (Squared)Hinge losses take {-1, 1} targets and a fixed margin of 1;
  this one reads the label's score out of the scores of all movies.
  """

  def __init__(self, margin: float = HINGE_MARGIN, name='positive_hinge'):
    super().__init__(name=name)
    self.margin = margin

  def call(self, y_true, y_pred):
    labels = tf.cast(tf.reshape(y_true, [-1]), tf.int32)
    positive = tf.gather(y_pred, labels, axis=1, batch_dims=1)
    return tf.square(tf.nn.relu(self.margin - positive))


class CandidateScores(tf.keras.layers.Layer):
  """Cosine of each context vector with every movie row of the shared table.

  The label tower is the (normalized) lookup of the shared embedding table;
  scoring all rows at once gives recall@10 over all movies. The padding
  column scores -2, below any cosine.
  """

  def __init__(self, embedding: tf.keras.layers.Embedding, **kwargs):
    super().__init__(**kwargs)
    self.embedding = embedding

  def call(self, context_vectors):
    rows = tf.math.l2_normalize(self.embedding.embeddings, axis=-1)
    scores = tf.matmul(tf.math.l2_normalize(context_vectors, axis=-1), rows,
                       transpose_b=True)
    is_pad = tf.one_hot(PAD_ID, tf.shape(rows)[0], dtype=scores.dtype)
    return scores * (1 - is_pad) - 2 * is_pad


def embedding_initializer(embedding_dim: int) -> tf.keras.initializers.Initializer:
  """Rows of norm about 1: N(0, 1/d) per coordinate.

  Both losses and the scores see the rows only through their directions
  (cosine, l2-normalized spreadout), so a row's norm |r| only sets how far a
  step turns it: the gradient is tangential and scales as 1/|r|, its
  curvature (the smoothness beta of [MixedFL] App. D) as 1/|r|^2. With
  Keras' default uniform(+-0.05) init (|r| ~ 0.12) one step of the paper's
  eta turns rows by far more than a radian, and 1-w GT, whose clients apply
  the spreadout gradient of x for all K steps (a stale step K * eta * w_c =
  2.5 per round), overshoots every round and inflates the row norms instead
  of spreading the rows out (docs/movielens.md). With unit rows that step
  is stable. Applied to every algorithm, the baseline included.
  """
  return tf.keras.initializers.RandomNormal(stddev=embedding_dim**-0.5)


def build_keras_model(num_rows: int, embedding_dim: int, context_length: int,
                      spreadout_weight: float = 0.0) -> tf.keras.Model:
  """context [batch, L] int32 -> scores of all num_rows ids [batch, num_rows]."""
  context = tf.keras.Input(shape=(context_length,), dtype=tf.int32,
                           name='context')
  embedding = tf.keras.layers.Embedding(
      num_rows, embedding_dim, mask_zero=True, name=EMBEDDING_LAYER,
      embeddings_initializer=embedding_initializer(embedding_dim),
      embeddings_regularizer=(SpreadoutRegularizer(spreadout_weight)
                              if spreadout_weight else None))
  bag = tf.keras.layers.GlobalAveragePooling1D(name='bag_of_movies')(
      embedding(context))
  context_vector = tf.keras.layers.Dense(embedding_dim,
                                         name='context_hidden')(bag)
  scores = CandidateScores(embedding, name='movie_scores')(context_vector)
  return tf.keras.Model(context, scores, name='movielens_dual_encoder')


def tower_floats(embedding_dim: int) -> int:
  """Weights outside the embedding table: the context dense layer."""
  return embedding_dim * embedding_dim + embedding_dim


def client_step_flops(batch_size, context_ids, embedding_dim: int,
                      num_movies: int, spreadout_on_clients: bool):
  """FLOPs of one client step ([MixedFL] App. C.3; see module docstring)."""
  d = float(embedding_dim)
  flops = (context_ids * d + 3 * batch_size * d * d +
           3 * batch_size * batch_size * d + 2 * batch_size)
  if spreadout_on_clients:
    flops += 0.5 * num_movies * num_movies * d + num_movies * d
  return flops


def build_task(config: base.DataConfig) -> base.Task:
  options = config.options
  # `or` would take an explicit 0 for unset.
  embedding_dim = int(options.get('movielens_embedding_dim', EMBEDDING_DIM))
  context_length = int(options.get('movielens_context_length',
                                   CONTEXT_LENGTH))
  spreadout_on_clients = bool(options.get('spreadout_on_clients', False))
  spreadout_weight = float(options.get('spreadout_weight', 1.0))
  if embedding_dim < 1:
    raise UsageError(f'--movielens_embedding_dim must be >= 1, got '
                     f'{embedding_dim}')
  if context_length < 1:
    raise UsageError(f'--movielens_context_length must be >= 1, got '
                     f'{context_length}')
  if context_length > movielens_files.MAX_ID:
    # Its window of context_length + 1 overflowed TF's int32 (a traceback).
    raise UsageError(f'--movielens_context_length must be at most '
                     f'{movielens_files.MAX_ID} (the largest movie id), got '
                     f'{context_length}')
  if not spreadout_weight >= 0:
    raise UsageError(f'--spreadout_weight must be >= 0, got '
                     f'{spreadout_weight}')

  ratings = load_ratings(config)
  num_rows = int(ratings['movie'].max()) + 1  # Row 0 is PAD_ID.
  num_movies = num_rows - 1
  if num_movies < RECALL_K:
    raise UsageError(f'movielens needs at least {RECALL_K} movies for '
                     f'recall@{RECALL_K}, the data have {num_movies}')
  users = split_users(ratings['user'], config.seed)
  train, server, val, test = (timelines(ratings, users[name]) for name in
                              ('train', 'server', 'val', 'test'))
  if not train.client_ids or not test.client_ids:
    raise UsageError('movielens: too few users to split into train and test '
                     f'clients ({len(np.unique(ratings["user"]))} users)')
  user_ids, counts = np.unique(ratings['user'], return_counts=True)
  for name in ('train', 'test'):
    # A user's first movie has no history: one rating gives no example.
    # Without any, the run trained on nothing (an update of 0/0) and logged
    # no evaluation, with status 0.
    if not np.any(counts[np.isin(user_ids, users[name])] >= 2):
      raise UsageError(f'movielens: no {name} user has two or more ratings, '
                       f'so the data give no {name} example (an example is a '
                       'movie after the user\'s earlier ones)')

  def client_dataset(client_id, seed):
    return base.client_batches(
        user_examples(train, client_id, context_length), config,
        seed).map(_to_batch)

  def server_batches(seed):
    return pooled_examples(server, context_length).shuffle(
        10 * config.central_batch_size, seed=seed).repeat().batch(
            config.central_batch_size).take(config.central_steps).map(
                _to_batch)

  def eval_datasets():
    return {name: pooled_examples(arrays, context_length).batch(
        config.eval_batch_size).map(_to_batch)
            for name, arrays in (('', test), ('val', val))}

  def keras_model():
    return build_keras_model(
        num_rows, embedding_dim, context_length,
        spreadout_weight if spreadout_on_clients else 0.0)

  table_index = [w.name.split('/')[0] for w in
                 keras_model().trainable_weights].index(EMBEDDING_LAYER)

  def central_spreadout(weights):
    return spreadout(weights.trainable[table_index])

  full_model_floats = num_rows * embedding_dim + tower_floats(embedding_dim)

  def client_cost(dataset):
    """A client's analytic costs of one round, from its batches."""

    def accumulate(totals, batch):
      touched, flops = totals
      context, label = batch
      ids = tf.concat([tf.reshape(context, [-1]), tf.reshape(label, [-1])], 0)
      touched = tf.logical_or(touched, tf.math.bincount(
          ids, minlength=num_rows, maxlength=num_rows) > 0)
      batch_size = tf.cast(tf.shape(label)[0], tf.float32)
      context_ids = tf.cast(tf.math.count_nonzero(context), tf.float32)
      return touched, flops + client_step_flops(
          batch_size, context_ids, embedding_dim, num_movies,
          spreadout_on_clients)

    touched, flops = dataset.reduce(
        (tf.zeros([num_rows], tf.bool), tf.constant(0.0)), accumulate)
    touched_rows = tf.cast(tf.math.count_nonzero(touched[PAD_ID + 1:]),
                           tf.float32)
    if spreadout_on_clients:
      model_floats = tf.constant(float(full_model_floats))
    else:
      model_floats = (touched_rows * embedding_dim +
                      tower_floats(embedding_dim))
    return collections.OrderedDict(
        flops=flops, touched_rows=touched_rows, model_floats=model_floats,
        full_model_floats=tf.constant(float(full_model_floats)),
        # The central loss (spreadout) reads the table only.
        central_gradient_floats=touched_rows * embedding_dim)

  def top_movies(scores):
    top = tf.math.top_k(scores, RECALL_K)
    return {'top_movies': top.indices, 'top_scores': top.values}

  serving = base.ServingSpec(
      input_name='context',
      input_spec=tf.TensorSpec([None, context_length], tf.int32),
      preprocess=lambda context: context, postprocess=top_movies)
  return base.Task(
      name='movielens',
      train_client_ids=train.client_ids,
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=keras_model,
      loss_fn=PositiveHinge,
      metrics_fn=lambda: [tf.keras.metrics.SparseTopKCategoricalAccuracy(
          k=RECALL_K, name=f'recall_at_{RECALL_K}')],
      batch_spec=(tf.TensorSpec([None, context_length], tf.int32),
                  tf.TensorSpec([None, 1], tf.int32)),
      eval_datasets_fn=eval_datasets,
      serving=serving,
      server_dataset_computation=base.server_dataset_computation(
          server_batches) if server.client_ids else None,
      central_loss_fn=central_spreadout,
      client_cost_fn=client_cost)

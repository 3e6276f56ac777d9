"""movielens_ratings: per-user rating prediction with FedRes.

Each MovieLens user is a client predicting its own ratings. The global model
sees the movie (an id embedding and the genre vector); each user's local
model maps the movie's genre vector to a personal offset (an affine map: the
user's taste per genre plus the user's own rating bias), which never leaves
the user. Each user's ratings are split in time: the latest TEST_FRACTION of
them (at least one) are held out, the rest are the client's train data.
Metrics: MSE loss, RMSE, MAE.

Reads ML-100K `u.data` (user, item, rating, timestamp; tab separated) and
`u.item` (`|` separated, Latin-1, the last 19 fields are genre flags) from
`--movielens_dir`; nothing is downloaded.
"""

import collections
import os

import numpy as np
import tensorflow as tf

from pipeline.errors import UsageError
from pipeline.errors import not_a_directory
from tasks import base
from tasks import client_arrays
from tasks import movielens_files
from tasks import residual

# Keys of `DataConfig.options` this task reads (registry.options).
OPTIONS = ('movielens_dir',)

RATINGS_FILE = movielens_files.ML_100K_RATINGS
MOVIES_FILE = 'u.item'
NUM_GENRES = 19
# id|title|release date|video release date|IMDb URL|19 genre flags.
ITEM_FIELDS = 5 + NUM_GENRES
TEST_FRACTION = 0.2
EMBEDDING_DIM = 8
HIDDEN_UNITS = 16

SYNTHETIC_USERS = 40
SYNTHETIC_MOVIES = 60


def _require_file(movielens_dir: str, name: str) -> str:
  path = os.path.join(movielens_dir, name)
  if not os.path.isfile(path):
    raise UsageError(f'--movielens_dir={movielens_dir} has no {name} '
                     '(MovieLens 100K files u.data and u.item are needed)')
  return path


def load_ratings(movielens_dir: str) -> dict[str, np.ndarray]:
  """u.data -> columns user, movie, rating, timestamp."""
  return movielens_files.read_ratings(_require_file(movielens_dir,
                                                    RATINGS_FILE))


def load_genres(movielens_dir: str) -> tuple[np.ndarray, np.ndarray]:
  """u.item -> (genre flags [max movie id + 1, 19] (row = movie id), whether
  each id is listed)."""
  path = _require_file(movielens_dir, MOVIES_FILE)
  rows = {}
  with open(path, encoding='latin-1') as f:
    for line_number, line in enumerate(f, 1):
      if not line.strip():
        continue
      # A line cut short (no newline, or fewer fields) read its last fields
      # as genre flags, or stopped the run with numpy's traceback; a flag
      # other than 0/1 or a movie listed twice trained silently.
      fields = line.rstrip('\r\n').split('|')
      try:
        if not line.endswith('\n'):
          raise ValueError('the file\'s last line has no newline (cut off '
                           'mid-line)')
        if len(fields) != ITEM_FIELDS:
          raise ValueError(f'{len(fields)} fields, not {ITEM_FIELDS}')
        movie = movielens_files.parse_int(fields[0])
        flags = [movielens_files.parse_int(flag)
                 for flag in fields[-NUM_GENRES:]]
        if not set(flags) <= {0, 1}:
          raise ValueError('a genre flag is not 0 or 1')
        if movie in rows:
          raise ValueError(f'movie {movie} is listed twice')
        rows[movie] = flags
      except ValueError as e:
        raise UsageError(f'{path}:{line_number} is not in the u.item format '
                         f'(id|title|...|{NUM_GENRES} genre flags): {e}'
                         ) from e
  if not rows:
    raise UsageError(f'{path} lists no movies (u.item format)')
  for movie in (min(rows), max(rows)):
    if not 1 <= movie <= movielens_files.MAX_ID:
      raise UsageError(f'{path} has movie id {movie}: ids must be in '
                       f'1..{movielens_files.MAX_ID}')
  genres = np.zeros((max(rows) + 1, NUM_GENRES), np.float32)
  listed = np.zeros(max(rows) + 1, bool)
  for movie, flags in rows.items():
    genres[movie] = flags
    listed[movie] = True
  return genres, listed


def synthetic_data(seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
  """Small ratings and genres with the structure of the real files."""
  rng = np.random.default_rng([seed, 100])
  genres = np.zeros((SYNTHETIC_MOVIES + 1, NUM_GENRES), np.float32)
  genres[1:] = rng.random((SYNTHETIC_MOVIES, NUM_GENRES)) < 0.2
  quality = rng.normal(0, 0.7, SYNTHETIC_MOVIES + 1)
  columns = collections.defaultdict(list)
  for user in range(1, SYNTHETIC_USERS + 1):
    taste = rng.normal(0, 0.8, NUM_GENRES)
    movies = rng.choice(np.arange(1, SYNTHETIC_MOVIES + 1),
                        size=rng.integers(10, 30), replace=False)
    scores = 3.5 + quality[movies] + genres[movies] @ taste
    columns['user'].append(np.full(len(movies), user))
    columns['movie'].append(movies)
    columns['rating'].append(np.clip(np.round(
        scores + rng.normal(0, 0.5, len(movies))), 1, 5).astype(np.float32))
    columns['timestamp'].append(rng.integers(8.8e8, 8.9e8, len(movies)))
  return {k: np.concatenate(v) for k, v in columns.items()}, genres


def temporal_split(ratings: dict[str, np.ndarray],
                   test_fraction: float = TEST_FRACTION
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Boolean (train, test) masks: each user's latest ratings are test.

  A user with n >= 2 ratings holds out max(1, round(test_fraction * n)) of
  its latest ones (ties in time broken by movie id); a single rating stays
  train.
  """
  order = np.lexsort((ratings['movie'], ratings['timestamp'], ratings['user']))
  users = ratings['user'][order]
  is_test = np.zeros(len(users), bool)
  boundaries = np.flatnonzero(np.diff(users)) + 1
  for start, end in zip(np.r_[0, boundaries], np.r_[boundaries, len(users)]):
    count = end - start
    if count >= 2:
      num_test = max(1, int(round(test_fraction * count)))
      is_test[end - num_test:end] = True
  test = np.zeros(len(users), bool)
  test[order] = is_test
  return ~test, test


def build_task(config: base.DataConfig) -> base.Task:
  if config.use_synthetic_data:
    ratings, genres = synthetic_data(config.seed)
    listed = np.ones(len(genres), bool)
    listed[0] = False
    source = 'the synthetic ratings'
  else:
    movielens_dir = config.options.get('movielens_dir')
    if not movielens_dir:
      raise UsageError('--movielens_dir is required for movielens_ratings '
                       '(a directory with MovieLens 100K u.data and u.item), '
                       'or pass --use_synthetic_data')
    if not os.path.isdir(movielens_dir):
      raise UsageError(f'--movielens_dir={movielens_dir} '
                       f'{not_a_directory(movielens_dir)}')
    ratings = load_ratings(movielens_dir)
    genres, listed = load_genres(movielens_dir)
    source = os.path.join(movielens_dir, RATINGS_FILE)
  # A movie missing between listed ones trained with no genre at all.
  rated = ratings['movie']
  in_range = (rated >= 0) & (rated < len(listed))
  unlisted = rated[~in_range | ~listed[np.where(in_range, rated, 0)]]
  if unlisted.size:
    raise UsageError(f'{source} rates movie {int(unlisted.min())}, which '
                     f'{MOVIES_FILE} does not list (of {unlisted.size} '
                     'ratings of unlisted movies); use the u.item of the '
                     'same MovieLens release')
  if ratings['user'].min() < 0:
    raise UsageError('u.data has negative user ids')
  train_mask, test_mask = temporal_split(ratings)
  if not test_mask.any():
    # The run trained, then evaluation failed on no data (Keras'
    # "Expected input data to be non-empty" traceback).
    raise UsageError(f'{source}: no user '
                     'has two or more ratings, so none is held out to '
                     'evaluate on (a user\'s latest ratings are its test '
                     'data)')

  def arrays(mask):
    return client_arrays.ClientArrays(ratings['user'][mask], {
        'movie_id': ratings['movie'][mask].astype(np.int32),
        'rating': ratings['rating'][mask]})

  num_movie_ids = len(genres)
  mean_rating = float(ratings['rating'][train_mask].mean())

  def model_input(movie_ids):
    return collections.OrderedDict(
        movie_id=movie_ids, genres=tf.gather(tf.constant(genres), movie_ids))

  def to_batch(rows):
    return model_input(rows['movie_id']), tf.expand_dims(rows['rating'], -1)

  def global_model():
    movie_id = tf.keras.Input(shape=(), dtype=tf.int32, name='movie_id')
    genre_flags = tf.keras.Input(shape=(NUM_GENRES,), name='genres')
    embedding = tf.keras.layers.Embedding(
        num_movie_ids, EMBEDDING_DIM,
        embeddings_initializer=tf.keras.initializers.RandomNormal(
            stddev=0.05))(movie_id)
    hidden = tf.keras.layers.Dense(HIDDEN_UNITS, activation='relu')(
        tf.keras.layers.Concatenate()([embedding, genre_flags]))
    rating = tf.keras.layers.Dense(
        1, bias_initializer=tf.keras.initializers.Constant(mean_rating))(
            hidden)
    return tf.keras.Model({'movie_id': movie_id, 'genres': genre_flags},
                          rating, name='global_model')

  spec = residual.ResidualModelSpec(
      global_model_fn=global_model,
      # The user's taste: genre flags -> rating offset (zero at first).
      local_model_fn=lambda: residual.linear_model(
          (NUM_GENRES,), 1, use_bias=True, name='user_taste'),
      split_inputs=lambda x: (x, x['genres']),
      input_spec=collections.OrderedDict(
          movie_id=tf.TensorSpec([None], tf.int32),
          genres=tf.TensorSpec([None, NUM_GENRES], tf.float32)),
      loss_fn=tf.keras.losses.MeanSquaredError,
      metrics_fn=lambda: [
          tf.keras.metrics.RootMeanSquaredError(name='rmse'),
          tf.keras.metrics.MeanAbsoluteError(name='mae')])
  serving = base.ServingSpec(
      input_name='movie_ids', input_spec=tf.TensorSpec([None], tf.int32),
      preprocess=model_input,
      postprocess=lambda ratings: {'rating': tf.squeeze(ratings, -1)})
  return client_arrays.build_task(
      'movielens_ratings', config, arrays(train_mask), arrays(test_mask),
      to_batch, tf.TensorSpec([None, 1], tf.float32), spec, serving)

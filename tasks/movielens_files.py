"""Reading MovieLens rating files (GroupLens formats), shared by the tasks.

ML-1M `ratings.dat`: `UserID::MovieID::Rating::Timestamp` per line.
ML-100K `u.data`: `user<TAB>item<TAB>rating<TAB>timestamp` per line.
Both give integer user and movie ids (from 1), ratings of whole stars 1..5
and Unix timestamps, at most one rating of a movie per user, and end every
line with a newline: a last line without one is a file cut off mid-line (its
last field may be cut short and still parse), refused like a line that does
not parse. Nothing is downloaded: the files must already be in the
directory given by `--movielens_dir`.
"""

import os
import re

import numpy as np

from pipeline.errors import UsageError
from pipeline.errors import not_a_directory

ML_1M_RATINGS = 'ratings.dat'
ML_100K_RATINGS = 'u.data'
# File name -> (field separator, layout shown in errors).
RATINGS_FORMATS = {
    ML_1M_RATINGS: ('::', 'UserID::MovieID::Rating::Timestamp'),
    ML_100K_RATINGS: ('\t', 'user<TAB>item<TAB>rating<TAB>timestamp'),
}
# Both formats rate in whole stars.
RATINGS_RANGE = (1, 5)
# Ids index the embedding tables (rows = largest id + 1). MovieLens 32M's
# largest movie id is 292757; a fedres_avg run of movielens_ratings with movie
# ids up to 1000000 peaked at 5.8 GB, and one up to 10000000 was killed for
# memory on a 24 GB machine.
MAX_ID = 1_000_000


def parse_int(field: str) -> int:
  """A decimal integer field; ValueError for anything else, such as the
  `1_9` or ` 12` that Python's int() takes."""
  if not re.fullmatch(r'-?[0-9]+', field):
    raise ValueError(f'{field!r} is not an integer')
  return int(field)


def read_ratings(path: str) -> dict[str, np.ndarray]:
  """A ratings file -> columns user, movie, rating (float32), timestamp.

  The format is chosen by the file name (`ratings.dat` or `u.data`).
  """
  name = os.path.basename(path)
  separator, layout = RATINGS_FORMATS[name]
  rows, line_numbers = [], []
  with open(path, encoding='latin-1') as f:
    for line_number, line in enumerate(f, 1):
      if not line.strip():
        continue
      if not line.endswith('\n'):
        raise UsageError(f'{path}:{line_number} is cut short: the file\'s '
                         'last line has no newline (a write or copy cut off '
                         'mid-line); restore the file')
      fields = line.rstrip('\r\n').split(separator)
      try:
        if len(fields) != 4:
          raise ValueError(f'{len(fields)} fields')
        row = [parse_int(field) for field in fields]
        too_large = [f for f, v in zip(fields, row) if abs(v) >= 2**63]
        if too_large:
          raise ValueError(f'{too_large[0].strip()} is beyond a 64-bit '
                           'integer')
        low, high = RATINGS_RANGE
        if not low <= row[2] <= high:
          raise ValueError(f'rating {row[2]} is outside {low}..{high} (whole '
                           'stars)')
        rows.append(row)
        line_numbers.append(line_number)
      except ValueError as e:
        raise UsageError(f'{path}:{line_number} is not in the {name} format '
                         f'({layout}): {e}') from e
  if not rows:
    raise UsageError(f'{path} has no ratings ({name} format: {layout})')
  table = np.array(rows, np.int64)
  for column, label in ((0, 'user'), (1, 'movie')):
    largest = int(table[:, column].max())
    if largest > MAX_ID:
      raise UsageError(f'{path} has {label} id {largest}: ids index the '
                       f'embedding tables, so they must be at most {MAX_ID}')
  # A second rating of a movie by its user (e.g. a file joined with a copy of
  # itself) would count twice in training and could land in both splits.
  pairs = table[:, :2]
  _, first = np.unique(pairs, axis=0, return_index=True)
  if len(first) < len(pairs):
    repeat = np.ones(len(pairs), bool)
    repeat[first] = False
    later = int(np.argmax(repeat))
    earlier = int(np.argmax(np.all(pairs == pairs[later], axis=1)))
    raise UsageError(
        f'{path}:{line_numbers[later]} rates movie {table[later, 1]} by user '
        f'{table[later, 0]} again (line {line_numbers[earlier]}): a user rates '
        'a movie once in MovieLens; restore the file')
  return {'user': table[:, 0], 'movie': table[:, 1],
          'rating': table[:, 2].astype(np.float32), 'timestamp': table[:, 3]}


def find_ratings(movielens_dir: str) -> str:
  """The ratings file of `movielens_dir`: ML-1M's if present, else ML-100K's."""
  if not os.path.isdir(movielens_dir):
    raise UsageError(f'--movielens_dir={movielens_dir} '
                     f'{not_a_directory(movielens_dir)}')
  for name in RATINGS_FORMATS:
    path = os.path.join(movielens_dir, name)
    if os.path.isfile(path):
      return path
    if os.path.lexists(path):
      # Passed over, the other format's file (if any) was read instead.
      kind = ('a directory' if os.path.isdir(path) else
              'a broken link' if not os.path.exists(path) else 'not a file')
      raise UsageError(f'{path} is {kind}, not a ratings file; restore it')
  raise UsageError(f'--movielens_dir={movielens_dir} has neither '
                   f'{ML_1M_RATINGS} (MovieLens 1M) nor {ML_100K_RATINGS} '
                   '(MovieLens 100K)')

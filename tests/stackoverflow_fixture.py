"""Tiny StackOverflow / Wikipedia files in the real on-disk formats.

`write_stackoverflow_sqlite` mirrors TFF's stackoverflow.sqlite (SqlClientData
schema: `examples` and `client_metadata` tables, splits train / heldout /
test, rows of serialized tf.train.Example with the fields TFF's loader
parses). `write_wikipedia_tfds` writes a prepared TFDS `wikipedia/20201201.en`
directory (tfrecord shards of the builder's own feature encoding plus the
metadata TFDS reads).
"""

import os
import sqlite3

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tasks import client_database
from tasks import stackoverflow_char

_WORDS = ('how', 'do', 'i', 'sort', 'a', 'list', 'in', 'python', '?', 'use',
          'sorted', '(', ')', '.', 'thanks', 'the', 'error', 'is', ':', 'null')
SPLITS = ('train', 'heldout', 'test')
TRAIN_WORDS = ('The', 'river', 'Rhine', 'flows', 'north', 'in', '1850,', 'and',
               'caf\u00e9s', 'opened.')
HELD_OUT_WORDS = ('Glacier', 'melts', 'slowly', 'every', 'summer;')


def _bytes_feature(value: bytes) -> tf.train.Feature:
  return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _example(tokens: str, score: int) -> bytes:
  features = {
      'creation_date': _bytes_feature(b'2010-01-08 09:34:05 UTC'),
      'score': tf.train.Feature(int64_list=tf.train.Int64List(value=[score])),
      'tags': _bytes_feature(b'python|sorting'),
      'title': _bytes_feature(b'how to sort a list'),
      'tokens': _bytes_feature(tokens.encode()),
      'type': _bytes_feature(b'question'),
  }
  return tf.train.Example(features=tf.train.Features(
      feature=features)).SerializeToString()


def write_stackoverflow_sqlite(path, clients_per_split=(4, 2, 3),
                               examples_per_client=6, seed=0) -> dict:
  """Returns {split: {client_id: [tokens strings]}} of what was written."""
  rng = np.random.default_rng(seed)
  written = {}
  with sqlite3.connect(path) as connection:
    client_database.create_sql_client_data_tables(connection)
    for split, count in zip(SPLITS, clients_per_split):
      written[split] = {}
      for i in range(count):
        client_id = f'{split}{i:05d}'
        sentences = [' '.join(rng.choice(_WORDS, size=int(rng.integers(5, 30))))
                     for _ in range(examples_per_client)]
        written[split][client_id] = sentences
        client_database.insert_client_examples(
            connection, split, client_id,
            [_example(sentence, int(rng.integers(0, 9)))
             for sentence in sentences])
  return written


def write_wikipedia_tfds(data_dir, num_articles=40, num_held_out=3,
                         num_shards=2) -> dict:
  """Returns {title: text} of the articles in the order TFDS reads them."""
  builder = tfds.builder(stackoverflow_char.WIKIPEDIA, data_dir=data_dir)
  dataset_dir = builder.data_dir
  os.makedirs(dataset_dir)
  candidates = [f'Fixture article {i}' for i in range(200 * num_held_out)]
  held_out = stackoverflow_char.is_wikipedia_eval_title(
      tf.constant(candidates)).numpy()
  titles = ([c for c, h in zip(candidates, held_out) if h][:num_held_out] +
            [c for c, h in zip(candidates, held_out) if not h][
                :num_articles - num_held_out])
  rng = np.random.default_rng(1)
  articles = {}
  for title in titles:
    # Held-out articles have their own words, so a test can tell them apart.
    vocabulary = HELD_OUT_WORDS if title in titles[:num_held_out] else (
        TRAIN_WORDS)
    words = rng.choice(vocabulary, size=int(rng.integers(20, 80)))
    articles[title] = ' '.join(words[:10]) + '\n' + ' '.join(words[10:])
  features = builder.info.features
  items = sorted(articles.items())
  in_file_order = {}
  for shard in range(num_shards):
    filename = (f'wikipedia-train.tfrecord-{shard:05d}-of-'
                f'{num_shards:05d}')
    with tf.io.TFRecordWriter(os.path.join(dataset_dir, filename)) as writer:
      for title, text in items[shard::num_shards]:
        writer.write(features.serialize_example(
            {'title': title, 'text': text}))
        in_file_order[title] = text
  tfds.folder_dataset.write_metadata(data_dir=dataset_dir, features=features,
                                     check_data=False)
  return in_file_order


def write_word_counts(cache_dir, sentences) -> list[str]:
  """`stackoverflow.word_count` where tf.keras.utils.get_file extracts it.

  Returns the words, most frequent first, as written ("word count" lines).
  """
  counts = {}
  for sentence in sentences:
    for word in sentence.split():
      counts[word] = counts.get(word, 0) + 1
  words = sorted(counts, key=lambda w: (-counts[w], w))
  directory = os.path.join(cache_dir, 'datasets')
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, 'stackoverflow.word_count'), 'w') as f:
    for word in words:
      f.write(f'{word} {counts[word]}\n')
  return words

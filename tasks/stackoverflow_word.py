"""stackoverflow_word: next-word prediction on TFF StackOverflow.

A plain federated task built on TFF's baseline
`tff.simulation.baselines.stackoverflow` (word prediction): its vocabulary
handling, preprocessing (a sentence -> [bos] + word ids (+ [eos]) truncated
to 20 words, padded), special tokens, recurrent model and metrics. The project
supplies what the baseline leaves to its caller: clients by id, seeded
shuffling (so a resumed run sees the same batches), K local steps, and an
evaluation set bounded by `--max_eval_sequences` (the real test split has 16.5M
sentences).

Data: `--cache_dir` holding TFF's `stackoverflow.sqlite` and the vocabulary
file `stackoverflow.word_count` (as `tf.keras.utils.get_file` extracts it
into `<cache_dir>/datasets/`; `--download` fetches what is missing);
`--use_synthetic_data` uses TFF's own synthetic StackOverflow (3 clients) and
its word counts. Model: TFF's LSTM language model, widths scaled by
`--model_width` (1.0: embedding 96, LSTM 670), output over the vocabulary
(`--word_vocab_size` most frequent words) plus pad, out-of-vocabulary, bos
and eos.
"""

import collections
import os

import tensorflow as tf
import tensorflow_federated as tff

from pipeline.errors import UsageError
from pipeline.errors import load_error
from tasks import base
from tasks import stackoverflow_char
# TFF's public create_word_prediction_task loads the vocabulary without its
# cache_dir (so always from the network or ~/.keras); its module's
# create_word_prediction_task_from_datasets, preprocessing and model are used
# directly instead (not public API: tff_internals).
from tff_algos import tff_internals

# Keys of `DataConfig.options` this task reads (registry.options).
OPTIONS = ('word_vocab_size', 'max_eval_sequences', 'model_width')
# The data-location flags it reads (registry.data_locations).
DATA_LOCATIONS = ('cache_dir', 'download')

_BASELINE = tff.simulation.baselines.stackoverflow
SEQUENCE_LENGTH = _BASELINE.DEFAULT_SEQUENCE_LENGTH
DEFAULT_VOCAB_SIZE = _BASELINE.DEFAULT_WORD_VOCAB_SIZE
NUM_OOV_BUCKETS = 1
WORD_COUNT_NAME = 'stackoverflow.word_count'
EMBEDDING_SIZE = 96
LSTM_SIZE = 670
DEFAULT_MAX_EVAL_SEQUENCES = 10000


def _read_word_counts(path: str, vocab_size: int) -> collections.OrderedDict:
  """The `word count` lines of TFF's file, most frequent first (as TFF)."""
  counts = collections.OrderedDict()
  first_lines = {}
  try:
    with open(path) as f:
      for line_number, line in enumerate(f, 1):
        if not line.endswith('\n'):
          # Cut off mid-line, its last word or count could be cut short and
          # still parse.
          raise ValueError(f'its last line {line!r} has no newline (a write '
                           'or copy cut off mid-line)')
        word, count = line.split()
        # A word counted twice or a negative count: not a count table (e.g.
        # two files joined); the vocabulary would silently take more lines.
        if word in counts:
          raise ValueError(f'line {line_number} counts {word!r} again (line '
                           f'{first_lines[word]})')
        if int(count) < 0:
          raise ValueError(f'line {line_number} gives {word!r} the negative '
                           f'count {count}')
        counts[word], first_lines[word] = int(count), line_number
        if len(counts) >= vocab_size:
          break
  except (OSError, ValueError) as e:
    raise UsageError(f'cannot read the StackOverflow vocabulary {path}: '
                     f'{e}') from e
  if not counts:
    # TFF's task builder refused the empty vocabulary with a traceback.
    raise UsageError(f'the StackOverflow vocabulary {path} holds no words '
                     '(lines `word count`)')
  if len(counts) < vocab_size:
    # TFF's file holds millions of words; a shorter one (e.g. a copy cut off
    # at a line's end) trained a smaller model than the flags recorded.
    raise UsageError(f'the StackOverflow vocabulary {path} holds '
                     f'{len(counts)} words, fewer than --word_vocab_size='
                     f'{vocab_size}; pass a --word_vocab_size of at most '
                     f'{len(counts)}, or restore the file')
  return counts


def load_vocab(config: base.DataConfig, vocab_size: int) -> list[str]:
  cache_dir = config.cache_dir
  for path in (os.path.join(cache_dir, 'datasets', WORD_COUNT_NAME),
               os.path.join(cache_dir, WORD_COUNT_NAME)):
    if os.path.isfile(path):
      return list(_read_word_counts(path, vocab_size))
  if not config.download:
    raise UsageError(f'--cache_dir={cache_dir} has no {WORD_COUNT_NAME} '
                     '(TFF StackOverflow vocabulary, in datasets/ or at the '
                     'top); pass --download to fetch it, or '
                     '--use_synthetic_data')
  try:
    return list(tff.simulation.datasets.stackoverflow.load_word_counts(
        cache_dir=cache_dir, vocab_size=vocab_size))
  except Exception as e:  # pylint: disable=broad-except
    # Without a network: a urllib traceback.
    raise load_error('the StackOverflow vocabulary',
                     os.path.join(cache_dir, 'datasets', WORD_COUNT_NAME),
                     e) from e


def build_task(config: base.DataConfig) -> base.Task:
  options = config.options
  vocab_size = stackoverflow_char.positive_option(
      options, 'word_vocab_size', DEFAULT_VOCAB_SIZE)
  max_eval_sequences = stackoverflow_char.positive_option(
      options, 'max_eval_sequences', DEFAULT_MAX_EVAL_SEQUENCES)
  width = options.get('model_width', 1.0)
  if width <= 0:
    raise UsageError(f'--model_width must be > 0, got {width}')
  if config.use_synthetic_data:
    train = tff.simulation.datasets.stackoverflow.get_synthetic()
    validation = test = train
    vocab = list(
        tff.simulation.datasets.stackoverflow.get_synthetic_word_counts())
  else:
    # The same cache_dir checks and error messages as stackoverflow_char.
    train, test = stackoverflow_char.load_stackoverflow(config)
    validation = None
    vocab = load_vocab(config, vocab_size)
  vocab = vocab[:vocab_size]

  # No shuffling inside TFF's preprocessing (shuffle_buffer_size=1): clients
  # shuffle with the driver's seed before it, evaluation keeps a fixed order.
  train_spec = tff.simulation.baselines.ClientSpec(
      num_epochs=1, batch_size=config.client_batch_size,
      shuffle_buffer_size=1)
  eval_spec = tff.simulation.baselines.ClientSpec(
      num_epochs=1, batch_size=config.eval_batch_size, shuffle_buffer_size=1)
  baseline = tff_internals.create_word_prediction_task_from_datasets(
      train_spec, eval_spec, SEQUENCE_LENGTH, vocab, NUM_OOV_BUCKETS,
      train_data=train, test_data=test, validation_data=validation)
  to_batches = baseline.datasets.train_preprocess_fn
  raw_examples = train.serializable_dataset_fn

  def client_dataset(client_id, seed):
    # Shuffle and repeat sentences, then TFF's preprocessing batches them;
    # K batches (or E epochs) as base.client_batches does for examples.
    sentences = raw_examples(client_id).shuffle(
        config.shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    if config.client_steps is not None:
      return to_batches(sentences.repeat()).take(config.client_steps)
    return to_batches(sentences).repeat(config.client_epochs)

  def eval_datasets():
    sentences = test.create_tf_dataset_from_all_clients(seed=0).take(
        max_eval_sequences)
    return {'': baseline.datasets.eval_preprocess_fn(sentences).cache()}

  special = tff_internals.get_special_tokens(
      len(vocab), num_out_of_vocab_buckets=NUM_OOV_BUCKETS)
  extended_vocab_size = len(vocab) + special.get_number_of_special_tokens()

  def metrics():
    # TFF's word prediction baseline's metrics.
    pad, oov, eos = (special.padding, special.out_of_vocab,
                     special.end_of_sentence)
    return [
        tff_internals.MaskedCategoricalAccuracy(
            name='accuracy', masked_tokens=[pad]),
        tff_internals.MaskedCategoricalAccuracy(
            name='accuracy_without_out_of_vocab', masked_tokens=[pad] + oov),
        tff_internals.MaskedCategoricalAccuracy(
            name='accuracy_without_out_of_vocab_or_end_of_sentence',
            masked_tokens=[pad, eos] + oov),
    ]

  def keras_model():
    return tff_internals.create_recurrent_model(
        vocab_size=extended_vocab_size,
        embedding_size=max(1, round(EMBEDDING_SIZE * width)),
        lstm_size=max(1, round(LSTM_SIZE * width)))

  serving = base.ServingSpec(
      input_name='word_ids',
      input_spec=tf.TensorSpec([None, None], tf.int64),
      preprocess=lambda ids: ids,
      postprocess=lambda logits: {
          'next_word_probabilities': tf.nn.softmax(logits)})
  return base.Task(
      name='stackoverflow_word',
      train_client_ids=tuple(train.client_ids),
      client_dataset_computation=base.client_dataset_computation(
          client_dataset),
      keras_model_fn=keras_model,
      loss_fn=lambda: tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True),
      metrics_fn=metrics,
      batch_spec=baseline.datasets.element_type_structure,
      eval_datasets_fn=eval_datasets,
      serving=serving)

"""tasks.cifar on TFDS data prepared from tiny files in CIFAR's binary format."""

import os
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
import tensorflow_federated as tff

from pipeline.errors import UsageError
from tasks import base
from tasks import cifar
from tasks import cifar_models
from tasks import dirichlet
import fault_testlib


TRAIN_PER_FILE = 12  # 5 files: 60 training images
NUM_TEST = 10
NUM_CLIENTS = 3
ALPHA = 0.5
SEED = 2


def _write_cifar10_binaries(directory: str) -> None:
  """The files of cifar-10-binary.tar.gz: records of label byte + 3072 bytes.

  Labels cycle through all classes so every class is present.
  """
  rng = np.random.default_rng(0)
  base_dir = os.path.join(directory, 'cifar-10-batches-bin')
  os.makedirs(base_dir)
  counter = 0
  files = [f'data_batch_{i}.bin' for i in range(1, 6)] + ['test_batch.bin']
  for name in files:
    size = NUM_TEST if name == 'test_batch.bin' else TRAIN_PER_FILE
    labels = (np.arange(counter, counter + size) % 10).astype(np.uint8)
    counter += size
    images = rng.integers(0, 256, size=(size, 3072), dtype=np.uint8)
    with open(os.path.join(base_dir, name), 'wb') as f:
      f.write(np.concatenate([labels[:, None], images], axis=1).tobytes())
  with open(os.path.join(base_dir, 'batches.meta.txt'), 'w') as f:
    f.write('\n'.join(f'class{i}' for i in range(10)))


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  """A TFDS data dir holding cifar10 prepared by TFDS's own CIFAR builder."""
  raw = str(tmp_path_factory.mktemp('cifar_raw'))
  _write_cifar10_binaries(raw)
  data_dir = str(tmp_path_factory.mktemp('tfds'))
  builder = tfds.builder('cifar10', data_dir=data_dir)
  # Offline: TFDS's download step is replaced by the files written above.
  with mock.patch.object(tfds.download.DownloadManager,
                         'download_and_extract', return_value=raw):
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return data_dir


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('cache'))


def _config(data_dir, cache_dir, **options):
  options = {'num_clients': NUM_CLIENTS, 'dirichlet_alpha': ALPHA,
             'model': 'resnet8', 'model_width': 0.125, **options}
  return base.DataConfig(client_batch_size=4, client_steps=3, seed=SEED,
                         data_dir=data_dir, cache_dir=cache_dir,
                         options=options)


@pytest.fixture(scope='module')
def task(data_dir, cache_dir):
  return cifar.build_cifar10(_config(data_dir, cache_dir))


def _tfds_split(data_dir, split):
  examples = list(tfds.builder('cifar10', data_dir=data_dir).as_dataset(
      split=split, shuffle_files=False).as_numpy_iterator())
  return (np.stack([e['image'] for e in examples]),
          np.array([e['label'] for e in examples]))


def test_clients_hold_the_dirichlet_partition(task, data_dir, cache_dir):
  images, labels = _tfds_split(data_dir, 'train')
  expected = dirichlet.dirichlet_partition(labels, NUM_CLIENTS, ALPHA, SEED)
  assert task.train_client_ids == ('client_0', 'client_1', 'client_2')
  # The stored partition, read back as TFF SqlClientData (un-augmented).
  (name,) = [f for f in os.listdir(os.path.join(cache_dir, 'partitions'))
             if f.startswith('cifar10_')]
  stored = tff.simulation.datasets.SqlClientData(
      os.path.join(cache_dir, 'partitions', name), split_name='train')
  for client_id, indices in zip(task.train_client_ids, expected):
    indices = np.sort(indices)  # Stored in pooled order.
    examples = list(stored.create_tf_dataset_for_client(client_id).map(
        cifar._parse_examples).as_numpy_iterator())  # pylint: disable=protected-access
    np.testing.assert_array_equal(
        np.stack([e['image'] for e in examples]), images[indices])
    np.testing.assert_array_equal([e['label'] for e in examples],
                                  labels[indices])
    # The client's training batches carry the same labels.
    batches = list(task.client_dataset_computation(client_id, 7))
    assert len(batches) == 3
    for x, y in batches:
      assert x.shape == (4, 32, 32, 3) and x.dtype == tf.float32
      assert set(y.numpy()) <= set(labels[indices])


def test_the_cached_partition_is_built_again_when_the_data_change(
    data_dir, tmp_path):
  # It was keyed by the data's location alone: a dataset prepared again in
  # place kept its old partition.
  cache = str(tmp_path / 'cache')
  cifar.build_cifar10(_config(data_dir, cache))
  (name,) = os.listdir(os.path.join(cache, 'partitions'))
  partition = os.path.join(cache, 'partitions', name)
  built = os.stat(partition).st_ino
  cifar.build_cifar10(_config(data_dir, cache))
  assert os.stat(partition).st_ino == built  # Reused.
  version_dir = tfds.builder('cifar10', data_dir=data_dir).data_dir
  shard = sorted(f for f in os.listdir(version_dir) if 'train' in f)[0]
  stat = os.stat(os.path.join(version_dir, shard))
  try:
    os.utime(os.path.join(version_dir, shard),
             ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    cifar.build_cifar10(_config(data_dir, cache))
  finally:
    os.utime(os.path.join(version_dir, shard),
             ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert os.stat(partition).st_ino != built  # Built again, then renamed.


def test_full_participation_by_default(task):
  assert task.default_clients_per_round == NUM_CLIENTS


def test_evaluation_is_the_normalized_test_split(task, data_dir):
  images, labels = _tfds_split(data_dir, 'test')
  (dataset,) = task.eval_datasets_fn().values()
  x = np.concatenate([b[0].numpy() for b in dataset])
  y = np.concatenate([b[1].numpy() for b in dataset])
  np.testing.assert_array_equal(y, labels)
  expected = (images / 255.0 - np.array(cifar.CIFAR10.mean)) / np.array(
      cifar.CIFAR10.std)
  np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-5)


def test_training_batches_are_reproducible_from_the_seed(task):
  first = [x.numpy() for x, _ in task.client_dataset_computation(
      'client_1', 11)]
  again = [x.numpy() for x, _ in task.client_dataset_computation(
      'client_1', 11)]
  other = [x.numpy() for x, _ in task.client_dataset_computation(
      'client_1', 12)]
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in zip(first, other))


def _crops_of(image: np.ndarray) -> list[np.ndarray]:
  padded = np.pad(image, [(4, 4), (4, 4), (0, 0)])
  crops = [padded[dy:dy + 32, dx:dx + 32] for dy in range(9)
           for dx in range(9)]
  return crops + [c[:, ::-1] for c in crops]


def test_augment_is_a_padded_crop_and_flip_per_image():
  rng = np.random.default_rng(3)
  images = rng.integers(1, 256, size=(48, 32, 32, 3), dtype=np.int64).astype(
      np.uint8)
  out = cifar.augment(tf.constant(images),
                      tf.constant([5, 9], tf.int64)).numpy()
  matches = []
  for image, augmented in zip(images, out):
    found = [k for k, c in enumerate(_crops_of(image))
             if np.array_equal(c, augmented)]
    assert found, 'output is not a crop (+flip) of its input'
    matches.append(found[0])
  # Offsets and flips differ between images of one batch.
  assert len(set(matches)) > 10
  assert any(m >= 81 for m in matches) and any(m < 81 for m in matches)
  np.testing.assert_array_equal(
      out, cifar.augment(tf.constant(images),
                         tf.constant([5, 9], tf.int64)).numpy())


def test_model_sizes_match_the_paper():
  # d from the FedPVR digest (3.1): VGG-11 and ResNet-8 for 10/100 classes.
  for model, classes, params, variables in (('vgg11', 10, 9_750_922, 22),
                                            ('vgg11', 100, 9_797_092, 22),
                                            ('resnet8', 10, 78_042, 29),
                                            ('resnet8', 100, 83_892, 29)):
    keras_model = cifar_models.MODELS[model](classes)
    assert keras_model.count_params() == params, model
    assert len(keras_model.trainable_variables) == variables, model
    # The classifier is last (FedPVR masks the last variables).
    assert keras_model.trainable_variables[-2].shape[-1] == classes
  vgg = cifar_models.vgg11(10)
  # VGG-11's three dense layers are variables 16..21 (FedPVR's start 16).
  assert [v.shape.as_list() for v in vgg.trainable_variables[16:]] == [
      [512, 512], [512], [512, 512], [512], [512, 10], [10]]


def test_resnet8_shortcut_is_the_strided_1x1_conv():
  """The shortcut takes every stride-th pixel into a 1x1 conv (TF 2.14's
  oneDNN filter gradient of a strided 1x1 conv with few input channels
  corrupts memory): the same function as the strided conv."""
  block = cifar_models.BasicBlock(8, stride=2)
  inputs = tf.constant(np.random.default_rng(0).normal(
      size=[3, 15, 15, 4]).astype(np.float32))
  block(inputs)
  kernel = block.shortcut_conv.kernel
  assert kernel.shape == [1, 1, 4, 8]
  np.testing.assert_allclose(
      block.shortcut_conv(inputs[:, ::2, ::2, :]).numpy(),
      tf.nn.conv2d(inputs, kernel, strides=2, padding='SAME').numpy(),
      rtol=1e-6, atol=1e-6)


def test_narrow_resnet8_trains_without_crashing(tmp_path):
  """--model_width below 1 crashed the native runtime (segmentation fault
  or glibc abort in the shortcut's filter gradient)."""
  done = fault_testlib.run_binary(
      'binaries.train', '--task=cifar10',
      '--algorithm=fedavg', '--use_synthetic_data', '--runtime=native',
      '--model=resnet8', '--model_width=0.5', '--num_clients=3',
      '--client_steps=1', '--total_rounds=1', '--experiment_name=narrow',
      f'--root_output_dir={tmp_path}')
  assert done.returncode == 0, done.stderr[-3000:]


def test_synthetic_data_has_the_real_structure(task):
  synthetic = cifar.build_cifar10(base.DataConfig(
      client_batch_size=4, client_steps=3, use_synthetic_data=True,
      options={'num_clients': 4, 'dirichlet_alpha': 1.0}))
  assert synthetic.train_client_ids == tuple(f'client_{j}' for j in range(4))
  assert synthetic.batch_spec == task.batch_spec
  assert (synthetic.client_dataset_computation.type_signature.result ==
          task.client_dataset_computation.type_signature.result)
  assert (next(iter(synthetic.eval_datasets_fn().values())).element_spec ==
          next(iter(task.eval_datasets_fn().values())).element_spec)
  assert synthetic.default_clients_per_round == 4
  cifar100 = cifar.build_cifar100(base.DataConfig(
      use_synthetic_data=True, options={'num_clients': 2, 'model': 'vgg11',
                                        'model_width': 1 / 16}))
  assert cifar100.keras_model_fn().output_shape == (None, 100)


def test_tfds_mock_data(tmp_path):
  with tfds.testing.mock_data(num_examples=40, data_dir=str(tmp_path)):
    mocked = cifar.build_cifar100(base.DataConfig(
        client_batch_size=5, client_steps=2, data_dir=str(tmp_path),
        options={'num_clients': 2, 'dirichlet_alpha': 1.0}))
    assert len(mocked.train_client_ids) == 2
    for client_id in mocked.train_client_ids:
      batches = list(mocked.client_dataset_computation(client_id, 1))
      assert len(batches) == 2
      assert all(0 <= y < 100 for _, ys in batches for y in ys.numpy())


def test_a_download_without_a_network_is_an_environment_fault(tmp_path):
  # It was a usage error (status 2) saying "in --data_dir=None", after TFDS's
  # retries; the same command works once the network is back.
  import socket  # pylint: disable=import-outside-toplevel
  import requests  # pylint: disable=import-outside-toplevel
  import urllib3  # pylint: disable=import-outside-toplevel
  from pipeline.errors import EnvironmentFault  # pylint: disable=import-outside-toplevel

  def offline(*args, **kwargs):
    del args, kwargs
    # The chain requests raises when a name does not resolve.
    try:
      try:
        raise socket.gaierror(-2, 'Name or service not known')
      except socket.gaierror as unresolved:
        raise urllib3.exceptions.MaxRetryError(
            None, '/~kriz/cifar-10-binary.tar.gz', unresolved) from unresolved
    except urllib3.exceptions.MaxRetryError as retried:
      raise requests.exceptions.ConnectionError(retried) from retried

  config = base.DataConfig(data_dir=str(tmp_path), download=True)
  expected = (
      f'cannot download TFDS cifar10 into {tmp_path}: [Errno -2] Name or '
      'service not known; check the network (or put the file there yourself) '
      'and re-run the same command')

  def unresolved(*args, **kwargs):
    del args, kwargs
    raise socket.gaierror(-2, 'Name or service not known')

  resolved = lambda *args, **kwargs: []
  no_proxy = mock.patch('urllib.request.getproxies', lambda: {})
  # A name that does not resolve fails at once, before TFDS's minutes of
  # retries.
  with no_proxy, mock.patch('socket.getaddrinfo', unresolved), \
      mock.patch.object(tfds.core.DatasetBuilder, 'download_and_prepare',
                        side_effect=AssertionError('not called')):
    with pytest.raises(EnvironmentFault) as raised:
      cifar.build_cifar10(config)
  assert str(raised.value) == expected
  # One that resolves but does not answer fails after TFDS's retries.
  with no_proxy, mock.patch('socket.getaddrinfo', resolved), \
      mock.patch.object(tfds.core.DatasetBuilder, 'download_and_prepare',
                        offline):
    with pytest.raises(EnvironmentFault) as raised:
      cifar.build_cifar10(config)
  assert str(raised.value) == expected
  # Behind a proxy names are the proxy's to resolve: not checked.
  with mock.patch('urllib.request.getproxies',
                  lambda: {'https': 'http://proxy:3128'}), \
      mock.patch('socket.getaddrinfo', unresolved), \
      mock.patch.object(tfds.core.DatasetBuilder, 'download_and_prepare',
                        offline):
    with pytest.raises(EnvironmentFault) as raised:
      cifar.build_cifar10(config)
  assert str(raised.value) == expected
  # Not a download failure: a usage error naming the directory.
  def broken(*args, **kwargs):
    del args, kwargs
    raise ValueError('checksum mismatch')

  with no_proxy, mock.patch('socket.getaddrinfo', resolved), \
      mock.patch.object(tfds.core.DatasetBuilder, 'download_and_prepare',
                        broken):
    with pytest.raises(UsageError) as raised:
      cifar.build_cifar10(config)
  assert str(raised.value) == (
      f'cannot prepare TFDS cifar10 in {tmp_path}: checksum mismatch')


def test_usage_errors(tmp_path, data_dir, cache_dir):
  with pytest.raises(UsageError, match='no prepared TFDS cifar10'):
    cifar.build_cifar10(_config(str(tmp_path), None))
  with pytest.raises(UsageError, match='--model=.mlp. is not a CIFAR model'):
    cifar.build_cifar10(_config(data_dir, cache_dir, model='mlp'))
  with pytest.raises(UsageError, match='--dirichlet_alpha must be > 0'):
    cifar.build_cifar10(_config(data_dir, cache_dir, dirichlet_alpha=0.0))
  with pytest.raises(UsageError, match='--num_clients=100'):
    cifar.build_cifar10(_config(data_dir, cache_dir, num_clients=100))


def _drop_half_the_records(path):
  records = list(tf.data.TFRecordDataset(str(path)).as_numpy_iterator())
  with tf.io.TFRecordWriter(str(path)) as writer:
    for record in records[:len(records) // 2]:
      writer.write(record)


@pytest.mark.parametrize('damage,found', [
    (os.remove, 'is missing: {shard} (No such file or directory)'),
    (_drop_half_the_records, 'hold fewer records than their metadata says '
     '(Input dataset was expected to contain'),
    (lambda path: open(path, 'wb').close(), 'hold fewer records than their '
     'metadata says (Input dataset was expected to contain'),
], ids=['deleted', 'records_dropped', 'emptied'])
def test_a_damaged_tfds_shard_is_one_error_line(data_dir, tmp_path, damage,
                                                found):
  """Each was a traceback of 50 lines."""
  import shutil  # pylint: disable=g-import-not-at-top
  copy = tmp_path / 'tfds'
  shutil.copytree(data_dir, copy)
  (shard,) = copy.glob('cifar10/*/*train.tfrecord-00000-of-*')
  damage(shard)
  done = fault_testlib.run_binary(
      'binaries.train', '--task=cifar10',
      '--algorithm=fedavg', f'--data_dir={copy}',
      f'--cache_dir={tmp_path / "cache"}', '--runtime=native',
      '--model=resnet8', '--model_width=0.125', f'--num_clients={NUM_CLIENTS}',
      '--client_steps=1', '--total_rounds=1', '--experiment_name=bad',
      f'--root_output_dir={tmp_path / "runs"}')
  assert done.returncode == 2, done.stderr[-3000:]
  assert 'Traceback' not in done.stderr, done.stderr[-3000:]
  (line,) = done.stderr.strip().splitlines()
  assert found.format(shard=shard) in line, line

"""The digits task: scikit-learn's bundled 8x8 digits split with s% similarity."""

import numpy as np
import pytest
import tensorflow as tf

from pipeline.errors import UsageError
from tasks import base
from tasks import digits
from tasks import registry


def _config(**options):
  return base.DataConfig(client_batch_size=3, client_steps=4, seed=0,
                         options=options)


def test_real_data_is_sklearn_digits_with_a_fixed_split():
  arrays = digits.load_arrays(use_synthetic_data=False)
  assert arrays.images.shape == (1797, 8, 8)
  assert arrays.images.min() == 0 and arrays.images.max() == 16
  assert set(np.unique(arrays.labels)) == set(range(10))
  train, test = digits.train_test_split(arrays, digits.NUM_TEST_IMAGES)
  assert len(train.labels) == 1500 and len(test.labels) == 297
  # Stratified: every class keeps roughly its share in test.
  assert np.bincount(test.labels, minlength=10).min() >= 25
  again_train, _ = digits.train_test_split(arrays, digits.NUM_TEST_IMAGES)
  np.testing.assert_array_equal(train.labels, again_train.labels)


def test_synthetic_data_has_the_real_element_structure():
  real = digits.load_arrays(False)
  fake = digits.load_arrays(True)
  assert fake.images.shape[1:] == real.images.shape[1:]
  assert fake.images.dtype == real.images.dtype
  assert fake.labels.dtype == real.labels.dtype
  assert fake.images.min() >= 0 and fake.images.max() <= 16
  assert set(np.unique(fake.labels)) == set(range(10))


def test_task_defaults_and_client_data():
  task = registry.build_task('digits', _config())
  assert task.num_train_clients == digits.DEFAULT_NUM_CLIENTS
  # Client 7's data, built by the task's TFF computation: K = 4 batches of 3
  # from its 15 images; similarity 0 gives one or two labels per client.
  batches = [(np.asarray(x), np.asarray(y))
             for x, y in task.client_dataset_computation('0007', 123)]
  assert len(batches) == 4
  features, _ = batches[0]
  assert features.shape == (3, 64) and features.dtype == np.float32
  assert 0.0 <= features.min() and features.max() <= 1.0
  assert len(np.unique(np.concatenate([b[1] for b in batches]))) <= 2
  model = task.keras_model_fn()
  assert [v.shape for v in model.trainable_variables] == [(64, 10), (10,)]
  eval_sets = task.eval_datasets_fn()
  assert sorted(eval_sets) == ['', 'train']
  assert sum(len(y) for _, y in eval_sets['']) == 297
  assert sum(len(y) for _, y in eval_sets['train']) == 1500


def test_options_choose_model_population_and_similarity():
  task = registry.build_task('digits', _config(
      model='mlp', num_clients=30, similarity=100.0))
  assert task.num_train_clients == 30
  model = task.keras_model_fn()
  assert [v.shape for v in model.trainable_variables] == [
      (64, digits.MLP_HIDDEN_UNITS), (digits.MLP_HIDDEN_UNITS,),
      (digits.MLP_HIDDEN_UNITS, 10), (10,)]
  logits = model(tf.zeros([2, 64]))
  assert logits.shape == (2, 10)


def test_cnn_has_four_layers_with_a_small_output_layer():
  task = registry.build_task('digits', _config(model='cnn', num_clients=10))
  model = task.keras_model_fn()
  assert [v.shape for v in model.trainable_variables] == [
      (3, 3, 1, 16), (16,), (3, 3, 16, 32), (32,), (512, 64), (64,),
      (64, 10), (10,)]
  assert model.count_params() == 38282
  logits = model(tf.zeros([2, 64]))
  assert logits.shape == (2, 10)


def test_dirichlet_alpha_deals_every_image_once_with_skewed_labels():
  train, _ = digits.train_test_split(digits.load_arrays(False),
                                     digits.NUM_TEST_IMAGES)
  clients = digits.client_partition(train.labels, 10, 0.0, 0.1, seed=0)
  assert sorted(np.concatenate(clients)) == list(range(1500))
  sizes = [len(c) for c in clients]
  assert min(sizes) >= 75 and len(set(sizes)) > 1  # unequal sizes
  # Client 3's data through the task's computation: its own images, all of
  # them when it takes whole epochs.
  config = base.DataConfig(client_batch_size=16, seed=0, options=dict(
      num_clients=10, dirichlet_alpha=0.1))
  task = registry.build_task('digits', config)
  labels = np.concatenate([np.asarray(y) for _, y in
                           task.client_dataset_computation('0003', 7)])
  np.testing.assert_array_equal(np.sort(labels),
                                np.sort(train.labels[clients[3]]))
  # alpha = 0.1: most clients are dominated by a few labels.
  top_two = [np.sort(np.bincount(train.labels[c], minlength=10))[-2:].sum()
             / len(c) for c in clients]
  assert np.median(top_two) > 0.6
  iid = digits.client_partition(train.labels, 10, 0.0, 100.0, seed=0)
  assert max(np.sort(np.bincount(train.labels[c], minlength=10))[-2:].sum()
             / len(c) for c in iid) < 0.4


@pytest.mark.parametrize('options,flag', [
    (dict(model='resnet'), '--model'),
    (dict(dirichlet_alpha=0.0), '--dirichlet_alpha'),
    (dict(dirichlet_alpha=-1.0), '--dirichlet_alpha'),
    (dict(dirichlet_alpha=0.5, similarity=0.0), '--dirichlet_alpha'),
    (dict(dirichlet_alpha=0.5, num_clients=0), '--num_clients'),
    (dict(dirichlet_alpha=0.001, num_clients=20), '--dirichlet_alpha'),
    (dict(similarity=101.0), '--similarity'),
    (dict(similarity=-5.0), '--similarity'),
    (dict(num_clients=0), '--num_clients'),
    (dict(num_clients=1501), '--num_clients'),
    (dict(l2_regularization=-0.1), '--l2_regularization'),
])
def test_bad_options_name_the_flag(options, flag):
  with pytest.raises(UsageError, match=flag):
    registry.build_task('digits', _config(**options))


@pytest.mark.parametrize('model', digits.MODELS)
def test_l2_regularization_adds_half_lambda_squared_kernels_to_both_losses(
    model):
  lam = 0.01
  task = registry.build_task('digits', _config(model=model,
                                               l2_regularization=lam))
  batch = next(iter(task.client_dataset_computation('0007', 123)))
  features, labels = (tf.constant(np.asarray(t)) for t in batch)
  learning_model = task.model_fn()
  kernels = [v.numpy() for v in learning_model.trainable_variables
             if 'kernel' in v.name]
  assert len(kernels) == {'logistic': 1, 'mlp': 2, 'cnn': 4}[model]
  penalty = 0.5 * lam * sum(float(np.sum(k.astype(np.float64)**2))
                            for k in kernels)
  logits = learning_model.predict_on_batch(features, training=False)
  cross_entropy = float(task.loss_fn()(labels, logits))
  # What every algorithm differentiates (tff.learning's forward pass) ...
  train_loss = float(learning_model.forward_pass((features, labels)).loss)
  np.testing.assert_allclose(train_loss, cross_entropy + penalty, rtol=1e-5)
  # The train/loss metric is tff.learning's, of the data loss alone (the
  # docs say so).
  total, weight = learning_model.report_local_unfinalized_metrics()['loss']
  np.testing.assert_allclose(float(total) / float(weight), cross_entropy,
                             rtol=1e-5)
  # ... and what evaluation reports as eval_train/loss (Keras' evaluate).
  keras_model = task.keras_model_fn()
  keras_model.set_weights([v.numpy()
                           for v in learning_model.trainable_variables])
  keras_model.compile(loss=task.loss_fn())
  eval_loss = keras_model.evaluate(features, labels, verbose=0)
  np.testing.assert_allclose(eval_loss, cross_entropy + penalty, rtol=1e-5)
  assert penalty > 1e-3 * cross_entropy  # the check can tell them apart


def test_serving_preprocess_takes_raw_images():
  images = tf.constant(np.full((2, 8, 8), 16.0, np.float32))
  features = digits.to_model_input(images)
  assert features.shape == (2, 64)
  np.testing.assert_allclose(features.numpy(), 1.0)


def test_a_repeated_batch_beyond_the_memory_is_a_usage_error():
  # With K steps the client's examples repeat until a batch is full, so the
  # batch is really built (it ran until the out-of-memory killer came).
  huge = base.DataConfig(client_batch_size=2**31 - 1, client_steps=2)
  with pytest.raises(UsageError, match=(
      r"^--client_batch_size=2147483647 is impossible: one batch of digits "
      r"examples takes at least [\d,.]+ GB, more than this machine's "
      r"[\d,.]+ GB of memory$")):
    registry.build_task('digits', huge)
  # Epochs: a batch holds at most the client's examples.
  task = registry.build_task('digits', base.DataConfig(
      client_batch_size=2**31 - 1, client_epochs=1))
  batches = list(task.client_dataset_computation(
      id=task.train_client_ids[0], seed=1))
  assert len(batches) == 1


@pytest.mark.parametrize('n, batch_size, epochs', [(3, 2, 2), (1, 2, 3),
                                                   (5, 4, 3), (4, 2, 2)])
def test_epochs_are_passes_of_their_own_batches(n, batch_size, epochs):
  # [FedAvg] Alg. 1: each epoch splits the client's data into batches of B.
  # The E passes were batched as one stream: ceil(E n / B) steps, batches
  # across two epochs, an example twice in a batch when n < B.
  config = base.DataConfig(client_batch_size=batch_size, client_epochs=epochs)
  batches = [b.numpy().tolist() for b in base.client_batches(
      tf.data.Dataset.range(n), config, tf.constant(7, tf.int64))]
  per_epoch = -(-n // batch_size)
  assert len(batches) == epochs * per_epoch
  passes = [sum(batches[e * per_epoch:(e + 1) * per_epoch], [])
            for e in range(epochs)]
  assert all(sorted(p) == list(range(n)) for p in passes)
  if n >= 4:
    assert len({tuple(p) for p in passes}) > 1  # reshuffled every epoch

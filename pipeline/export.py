"""Export of the global model as a SavedModel with `serving_default`."""

import os
import shutil

import tensorflow as tf
import tensorflow_federated as tff

from pipeline import evaluation
from tasks import base


def export_saved_model(task: base.Task,
                       weights: tff.learning.models.ModelWeights,
                       export_dir: str) -> str:
  """Writes the model to `export_dir`, replacing an older export atomically."""
  model = evaluation.keras_model_with_weights(task, weights)
  serving = task.serving
  module = tf.Module()
  module.model = model
  # Plain variable lists, so `load_model_weights` can read the weights back
  # without Keras (evaluation of an export).
  module.trainable_weights = list(model.trainable_weights)
  module.non_trainable_weights = list(model.non_trainable_weights)

  @tf.function(input_signature=[
      tf.TensorSpec(serving.input_spec.shape, serving.input_spec.dtype,
                    name=serving.input_name)])
  def serve(inputs):
    return dict(serving.postprocess(
        model(serving.preprocess(inputs), training=False)))

  module.serve = serve
  export_dir = os.path.abspath(export_dir)
  staging = export_dir + '.staging'
  retired = export_dir + '.old'
  for path in (staging, retired):
    shutil.rmtree(path, ignore_errors=True)
  tf.saved_model.save(module, staging, signatures={'serving_default': serve})
  if os.path.exists(export_dir):
    os.rename(export_dir, retired)
  os.rename(staging, export_dir)
  shutil.rmtree(retired, ignore_errors=True)
  return export_dir


def load_model_weights(export_dir: str) -> tff.learning.models.ModelWeights:
  """The global model's weights stored in an export."""
  loaded = tf.saved_model.load(export_dir)
  return tff.learning.models.ModelWeights(
      trainable=[v.numpy() for v in loaded.trainable_weights],
      non_trainable=[v.numpy() for v in loaded.non_trainable_weights])

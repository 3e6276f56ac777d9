"""Export of the global model as a SavedModel with `serving_default`."""

import os
import shutil
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline import evaluation
from pipeline.errors import UsageError
from tasks import base

EXPORT_DIR = 'export'
# Files that make a directory a run rather than an export.
_RUN_ENTRIES = ('checkpoints', 'metrics.csv', 'hparams.json')


def _is_within(path: str, directory: str) -> bool:
  return os.path.commonpath([path, directory]) == directory


def check_export_dir(export_dir: str, run_dir: str) -> None:
  """UsageError unless writing an export to `export_dir` replaces nothing but
  an earlier export: not the run directory, a directory holding it, a place
  inside it other than its own export/, a run's directory, or a directory
  that holds something else."""
  target = os.path.realpath(export_dir)
  run = os.path.realpath(run_dir)
  own = os.path.join(run, EXPORT_DIR)
  flag = f'--export_dir={export_dir}'
  if _is_within(run, target):
    raise UsageError(f'{flag} would replace the run directory {run_dir} (or '
                     'a directory holding it); choose a new directory')
  if _is_within(target, run) and target != own:
    raise UsageError(f'{flag} is inside the run directory {run_dir}; export '
                     f'to its {EXPORT_DIR}/ (the default) or outside it')
  if not os.path.lexists(target):
    return
  if not os.path.isdir(target):
    raise UsageError(f'{flag} is a file, not a directory')
  entries = os.listdir(target)
  if any(name in entries for name in _RUN_ENTRIES):
    raise UsageError(f'{flag} holds a run ({", ".join(_RUN_ENTRIES)}); '
                     'choose a new directory')
  if entries and 'saved_model.pb' not in entries:
    raise UsageError(f'{flag} exists and is not an export (no '
                     'saved_model.pb) - it would be replaced; choose a new '
                     'or empty directory')


def export_saved_model(
    task: base.Task, weights: tff.learning.models.ModelWeights,
    export_dir: str,
    write_more: Optional[Callable[[str], None]] = None) -> str:
  """Writes the model to `export_dir`, replacing an older export atomically.

  `write_more(directory)` adds files (e.g. personal models) to the new export
  before it replaces the old one, so an export is complete or absent.
  """
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
  os.makedirs(staging)  # An unwritable place fails here, with its path.
  tf.saved_model.save(module, staging, signatures={'serving_default': serve})
  if write_more is not None:
    write_more(staging)
  if os.path.exists(export_dir):
    os.rename(export_dir, retired)
  os.rename(staging, export_dir)
  shutil.rmtree(retired, ignore_errors=True)
  return export_dir


def _shapes(shapes: list[list[int]], at_most: int = 4) -> str:
  text = ' '.join('x'.join(map(str, shape)) or 'scalar'
                  for shape in shapes[:at_most])
  return text + (f' ... ({len(shapes)} in all)' if len(shapes) > at_most
                 else '')


def load_model_weights(
    export_dir: str,
    task: Optional[base.Task] = None) -> tff.learning.models.ModelWeights:
  """The global model's weights stored in an export; with `task`, checked
  to be weights of the task's model (UsageError otherwise)."""
  flag = f'--export_dir={export_dir}'
  if not os.path.isfile(os.path.join(export_dir, 'saved_model.pb')):
    raise UsageError(f'{flag} holds no SavedModel')
  try:
    loaded = tf.saved_model.load(export_dir)
    weights = tff.learning.models.ModelWeights(
        trainable=[v.numpy() for v in loaded.trainable_weights],
        non_trainable=[v.numpy() for v in loaded.non_trainable_weights])
  except Exception as e:  # pylint: disable=broad-except
    # A damaged SavedModel fails in many ways (DecodeError, OpError, a
    # missing attribute of another kind of SavedModel, ...).
    raise UsageError(f'{flag} is not a readable export of this pipeline '
                     f'({type(e).__name__})') from e
  if task is not None:
    expected = tff.learning.models.ModelWeights.from_model(
        task.keras_model_fn())
    shapes = [list(np.shape(w))
              for w in weights.trainable + weights.non_trainable]
    wanted = [list(np.shape(w))
              for w in expected.trainable + expected.non_trainable]
    if shapes != wanted:
      raise UsageError(f'{flag} holds another model than task {task.name}\'s '
                       f'(weight shapes {_shapes(shapes)}, expected '
                       f'{_shapes(wanted)})')
  return weights

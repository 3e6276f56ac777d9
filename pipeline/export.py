"""Export of the global model as a SavedModel with `serving_default`."""

import os
import re
import shutil
import tempfile
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from pipeline import errors
from pipeline import evaluation
from pipeline import private_temp
from pipeline import run_directory
from pipeline.errors import UsageError
from tasks import base

EXPORT_DIR = 'export'
# Files that make a directory a run rather than an export.
_RUN_ENTRIES = ('checkpoints', 'metrics.csv', 'hparams.json')

# What an export of this pipeline holds: a SavedModel as
# tf.saved_model.save writes it, plus (FedRes,
# tff_algos/algorithms/fedres/export.py) the local-model store and a second
# SavedModel in personalized/. Anything else in an export directory is not
# this pipeline's, and replacing the directory would lose it.
_VARIABLES = re.compile(r'variables\.(index|data-\d{5}-of-\d{5})$')
_SAVED_MODEL = {'saved_model.pb': None, 'fingerprint.pb': None,
                'variables': {_VARIABLES: None}, 'assets': {}}
_EXPORT_LAYOUT = {**_SAVED_MODEL, 'local_models.sqlite': None,
                  'personalized': _SAVED_MODEL}


def _is_within(path: str, directory: str) -> bool:
  return os.path.commonpath([path, directory]) == directory


def _layout_entry(layout: dict, name: str):
  """(True, what `name` is in `layout`: None for a file, a dict for a
  directory) or (False, None) if an export holds no such entry."""
  for key, value in layout.items():
    if key == name if isinstance(key, str) else key.match(name):
      return True, value
  return False, None


def _foreign_entry(directory: str, layout: dict = _EXPORT_LAYOUT
                   ) -> Optional[str]:
  """The relative path of something in `directory` that an export of this
  pipeline does not write (a symbolic link never is), else None."""
  for entry in sorted(os.scandir(directory), key=lambda e: e.name):
    known, inner = _layout_entry(layout, entry.name)
    is_dir = entry.is_dir(follow_symlinks=False)
    if (not known or entry.is_symlink() or is_dir != (inner is not None) or
        not (is_dir or entry.is_file(follow_symlinks=False))):
      return entry.name
    if is_dir:
      foreign = _foreign_entry(entry.path, inner)
      if foreign is not None:
        return os.path.join(entry.name, foreign)
  return None


def check_replaceable(export_dir: str, label: Optional[str] = None) -> None:
  """UsageError unless `export_dir` is absent or an export directory holding
  nothing but what an export of this pipeline writes, so replacing it loses
  nothing else. `label` names it in the message (default: its path)."""
  label = label or export_dir
  if not os.path.lexists(export_dir):
    return
  if os.path.islink(export_dir):
    raise UsageError(f'{label} is a symbolic link; give the directory it '
                     'stands for')
  if not os.path.isdir(export_dir):
    raise UsageError(f'{label} is a file, not a directory')
  entries = os.listdir(export_dir)
  if any(name in entries for name in _RUN_ENTRIES):
    raise UsageError(f'{label} holds a run ({", ".join(_RUN_ENTRIES)}); '
                     'choose a new directory')
  foreign = _foreign_entry(export_dir)
  if foreign is not None:
    raise UsageError(f'{label} holds {foreign}, which is not part of an '
                     'export of this pipeline: replacing the export would '
                     'lose it; move it away' + (
                         ', or choose a new or empty directory'
                         if label != export_dir else ''))


def check_export_dir(export_dir: str, run_dir: str) -> None:
  """UsageError unless writing an export to `export_dir` replaces nothing but
  an earlier export: not the run directory, a directory holding it, a place
  inside it other than its own export/, a place inside another run's
  directory, a run's directory, or a directory that holds anything an
  export does not (`check_replaceable`)."""
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
  other_run = run_directory.enclosing_run_dir(target, run)
  if other_run is not None:
    raise UsageError(f'{flag} is inside the directory of another run, '
                     f'{other_run}; export outside run directories')
  check_replaceable(export_dir, flag)


def _staging_dir(export_dir: str) -> tuple[str, int]:
  """A new directory beside `export_dir`, named `<name>.<random>.staging`,
  and the descriptor that marks it as this process's while it is open (a
  resume of a run removes one its export left in the run directory; an
  export elsewhere, one a killed export left beside it:
  `recover_abandoned_staging`)."""
  parent, name = os.path.split(export_dir)
  try:
    os.makedirs(parent, exist_ok=True)  # An unwritable place fails here.
    staging = tempfile.mkdtemp(prefix=f'{name}.', suffix='.staging',
                               dir=parent)
    return staging, private_temp.lock_as_owner(staging)
  except OSError as e:
    if e.errno not in errors.ENVIRONMENT_ERRNOS:
      # A place the kernel makes no directories in (/proc): a traceback.
      raise errors.EnvironmentFault(
          f'{export_dir} cannot be written: no directory can be made in '
          f'{parent if os.path.isdir(parent) else e.filename} '
          f'({e.strerror}); export to another directory (--export_dir)'
      ) from None
    # Named by its directory: the random name would tell the user nothing.
    raise OSError(e.errno, e.strerror, parent) from e


def recover_abandoned_staging(export_dir: str) -> None:
  """Removes the staging directories exports to `export_dir` left when they
  were killed (their process is gone); one killed between moving the old
  export aside and the new one in first gets the old export back."""
  parent, name = os.path.split(export_dir)
  staging_name = re.compile(re.escape(name) + r'\.[a-z0-9_]{8}\.staging')
  for entry in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
    staging = os.path.join(parent, entry)
    if (not staging_name.fullmatch(entry) or
        not private_temp.owner_is_gone(staging)):
      continue
    run_directory.put_back_retired_export(staging, export_dir)
    shutil.rmtree(staging)


def export_saved_model(
    task: base.Task, weights: tff.learning.models.ModelWeights,
    export_dir: str,
    write_more: Optional[Callable[[str], None]] = None) -> str:
  """Writes the model to `export_dir`, replacing an older export atomically.

  `write_more(directory)` adds files (e.g. personal models) to the new export
  before it replaces the old one, so an export is complete or absent. Only
  an export may be replaced (`check_replaceable`, UsageError otherwise), and
  nothing is deleted but what this call wrote and the export it replaces:
  the new export is written in a directory of a new, unique name beside
  `export_dir`.
  """
  export_dir = os.path.abspath(export_dir)
  recover_abandoned_staging(export_dir)
  check_replaceable(export_dir)
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
                    name=serving.input_name)],
               autograph=False)
  def serve(inputs):
    return dict(serving.postprocess(
        model(serving.preprocess(inputs), training=False)))

  module.serve = serve
  staging, owner_lock = _staging_dir(export_dir)
  new = os.path.join(staging, 'new')
  retired = os.path.join(staging, 'old')
  try:
    tf.saved_model.save(module, new, signatures={'serving_default': serve})
    if write_more is not None:
      write_more(new)
    check_replaceable(export_dir)  # Again: it may have changed meanwhile.
    if os.path.lexists(export_dir):
      os.rename(export_dir, retired)
    try:
      os.rename(new, export_dir)
    except BaseException:
      if os.path.lexists(retired):
        os.rename(retired, export_dir)
      raise
  except BaseException:
    # Only what this call wrote; an old export it could not put back stays.
    shutil.rmtree(new, ignore_errors=True)
    if not os.path.lexists(retired):
      shutil.rmtree(staging, ignore_errors=True)
    raise
  finally:
    os.close(owner_lock)
  shutil.rmtree(staging)
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
    errors.raise_if_unreadable(export_dir)
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

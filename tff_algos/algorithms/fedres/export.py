"""Export of FedRes personal models, and serving a client's prediction.

Beside the global SavedModel that the driver writes to `export/`, FedRes adds

  export/local_models.sqlite   every client's theta_i (the local-model store;
                               with --fedres_fit_unseen also the theta the
                               personalized evaluation fits for each evaluated
                               client without one)
  export/personalized/         a SavedModel whose `serving_default` takes the
                               task's serving input plus one client's
                               `local_weights` and returns the personalized
                               prediction f_w(x_g) + f_theta(x_l)

`local_models.sqlite` has tables `local_models(client_id, local_weights,
sha256)` and `metadata(key, value)`; a `local_weights` blob is the local
model's variables flattened in order and concatenated, little-endian float32
(metadata `variable_shapes` gives the shapes, `initial_local_weights` the
theta of a client without a row). `sha256` is the hex SHA-256 of the client
id (UTF-8), a NUL byte and the blob, and `initial_local_weights.sha256` that
of the initial blob: sqlite checks its pages' structure, not the values in
them, so a changed byte of a blob, or two clients' rows swapped, would
otherwise be served as a client's model. `serve_personalized` puts the two
together.
"""

import hashlib
import json
import os
import re
import shutil
import sqlite3
import threading
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from pipeline.errors import UsageError
from tasks import base
from tff_algos.algorithms.fedres import math as fedres_tf

LOCAL_MODELS_FILE = 'local_models.sqlite'
PERSONALIZED_DIR = 'personalized'
_INITIAL_KEY = 'initial_local_weights'
_SHAPES_KEY = 'variable_shapes'
_INITIAL_CHECKSUM_KEY = _INITIAL_KEY + '.sha256'


def _checksum(owner: str, blob: bytes) -> str:
  """What a row's `sha256` holds: its owner (a client id, or the metadata
  key of the initial model) is part of it, so a row under another id fails."""
  return hashlib.sha256(owner.encode('utf-8') + b'\0' + blob).hexdigest()


def _row(owner: str, weights) -> tuple[str, bytes, str]:
  blob = flatten_weights(weights).tobytes()
  return owner, blob, _checksum(owner, blob)


def flatten_weights(weights: Sequence[np.ndarray]) -> np.ndarray:
  return np.concatenate(
      [np.asarray(w, np.float32).reshape(-1) for w in weights]).astype('<f4')


def export_personal_models(task: base.Task,
                           global_weights: Sequence[np.ndarray], store,
                           local_weights_of: Callable[[Any], Sequence[Any]],
                           initial_local_weights: Sequence[np.ndarray],
                           export_dir: str,
                           fitted_local_weights: Optional[
                               Mapping[str, Sequence[np.ndarray]]] = None
                           ) -> None:
  """Writes the local-model store and the personalized SavedModel.

  `fitted_local_weights` (client id -> theta) adds the thetas the
  personalized evaluation fitted for clients without a stored state
  (`--fedres_fit_unseen`).
  """
  _write_local_models(os.path.join(export_dir, LOCAL_MODELS_FILE), store,
                      local_weights_of, initial_local_weights,
                      fitted_local_weights or {})
  _save_personalized_model(task, global_weights,
                           os.path.join(export_dir, PERSONALIZED_DIR))


def _write_local_models(path: str, store, local_weights_of,
                        initial_local_weights, fitted_local_weights) -> None:
  staging = path + '.staging'
  if os.path.exists(staging):
    os.remove(staging)
  connection = sqlite3.connect(staging)
  try:
    with connection:
      connection.execute('CREATE TABLE local_models (client_id TEXT PRIMARY '
                         'KEY, local_weights BLOB NOT NULL, sha256 TEXT NOT '
                         'NULL)')
      connection.execute('CREATE TABLE metadata (key TEXT PRIMARY KEY, '
                         'value BLOB NOT NULL)')
      connection.execute(
          'INSERT INTO metadata VALUES (?, ?)',
          (_SHAPES_KEY, json.dumps(
              [list(np.shape(w)) for w in initial_local_weights])))
      _, initial, initial_checksum = _row(_INITIAL_KEY, initial_local_weights)
      connection.executemany('INSERT INTO metadata VALUES (?, ?)', (
          (_INITIAL_KEY, initial), (_INITIAL_CHECKSUM_KEY, initial_checksum)))
      connection.executemany(
          'INSERT INTO local_models VALUES (?, ?, ?)',
          (_row(client_id, local_weights_of(state))
           for client_id, state in store.items()))
      connection.executemany(
          'INSERT INTO local_models VALUES (?, ?, ?)',
          (_row(client_id, weights)
           for client_id, weights in sorted(fitted_local_weights.items())))
  finally:
    connection.close()
  os.replace(staging, path)


def _save_personalized_model(task: base.Task,
                             global_weights: Sequence[np.ndarray],
                             path: str) -> None:
  spec = task.residual_spec
  serving = task.serving
  model = fedres_tf.ResidualModel(spec)
  fedres_tf.assign(model.global_weights, global_weights)
  local_variables = model.local_weights
  sizes = [int(np.prod(v.shape)) for v in local_variables]
  module = tf.Module()
  module.global_model = model.global_model
  module.local_model = model.local_model

  @tf.function(input_signature=[
      tf.TensorSpec(serving.input_spec.shape, serving.input_spec.dtype,
                    name=serving.input_name),
      tf.TensorSpec([sum(sizes)], tf.float32, name='local_weights')],
               autograph=False)
  def serve(inputs, local_weights):
    # One client's theta is an input, so the export serves every client; it
    # is written into the local model's variables before they are read.
    for variable, piece in zip(local_variables,
                               tf.split(local_weights, sizes)):
      variable.assign(tf.reshape(piece, variable.shape))
    return dict(serving.postprocess(
        model.outputs(serving.preprocess(inputs), training=False)))

  module.serve = serve
  staging = path + '.staging'
  shutil.rmtree(staging, ignore_errors=True)
  tf.saved_model.save(module, staging, signatures={'serving_default': serve})
  shutil.rmtree(path, ignore_errors=True)
  os.rename(staging, path)


def local_weights_for(export_dir: str, client_id: str,
                      size: Optional[int] = None) -> tuple[np.ndarray, bool]:
  """(flat theta of `client_id`, whether the export has a row for it);
  UsageError unless theta is finite and, with `size`, that many values."""
  path = os.path.join(export_dir, LOCAL_MODELS_FILE)
  if not os.path.isfile(path):
    raise UsageError(f'{export_dir} has no {LOCAL_MODELS_FILE}: not the '
                     'export of a FedRes run')
  try:
    client_id.encode('utf-8')
  except UnicodeEncodeError as e:  # From bytes in argv that are not UTF-8.
    raise UsageError(f'client id {client_id!r} is not UTF-8 text: no client '
                     'has it') from e
  connection = sqlite3.connect(f'file:{path}?mode=ro', uri=True)
  try:
    row = connection.execute(
        'SELECT local_weights, sha256 FROM local_models WHERE client_id = ?',
        (client_id,)).fetchone()
    found = row is not None
    if not found:
      row = connection.execute(
          'SELECT a.value, b.value FROM metadata a, metadata b WHERE '
          'a.key = ? AND b.key = ?',
          (_INITIAL_KEY, _INITIAL_CHECKSUM_KEY)).fetchone()
  except sqlite3.DatabaseError as e:
    if 'no such column: sha256' in str(e):
      raise UsageError(f'{path} was written before local models had '
                       'checksums; export the run again') from e
    raise UsageError(f'{path} is not a local-model store of a FedRes export '
                     f'({e})') from e
  finally:
    connection.close()
  if row is None:
    raise UsageError(f'{path} has no stored local model for {client_id!r} '
                     'nor an initial one: it is damaged')
  which = (f'the local model of client {client_id!r}' if found else
           f'the initial local model (client {client_id!r} has none)')
  blob, checksum = row
  if not isinstance(blob, bytes) or len(blob) % 4 or (
      size is not None and len(blob) != 4 * size):
    stored = (f'{len(blob)} bytes' if isinstance(blob, bytes) else
              f'a {type(blob).__name__}')
    wanted = f'{size} float32 values' if size is not None else 'float32 values'
    raise UsageError(f'{path}: {which} is {stored}, not {wanted}: the file '
                     'is damaged')
  if checksum != _checksum(client_id if found else _INITIAL_KEY, blob):
    raise UsageError(f'{path}: {which} does not match its checksum: the file '
                     'is damaged (or its rows were changed); export the run '
                     'again')
  weights = np.frombuffer(blob, '<f4').astype(np.float32)
  if not np.all(np.isfinite(weights)):
    raise UsageError(f'{path}: {which} holds non-finite values (NaN or '
                     'inf): the file is damaged')
  return weights, found


class InputError(UsageError):
  """Serving inputs the model cannot take (callers name where they came
  from)."""


def _op_error_detail(error: tf.errors.OpError) -> str:
  """The line of a graph execution error that says what was wrong (e.g.
  `indices[1] = 999 is not in [0, 61)`), without TF's frame."""
  for line in error.message.splitlines():
    line = line.strip()
    if line and not line.startswith(('Graph execution error', 'Detected at',
                                     '<stack traces', '[[')):
      return re.sub(r'\s*\[Op:\w+\]$', '', line)
  return type(error).__name__


class PersonalizedServer:
  """Serves personalized predictions from a FedRes export (loaded once)."""

  def __init__(self, export_dir: str):
    model_dir = os.path.join(export_dir, PERSONALIZED_DIR)
    if not os.path.isfile(os.path.join(model_dir, 'saved_model.pb')):
      raise UsageError(f'{export_dir} has no {PERSONALIZED_DIR}/ SavedModel: '
                       'not the export of a FedRes run')
    self._export_dir = export_dir
    try:
      self._loaded = tf.saved_model.load(model_dir)
      self._signature = self._loaded.signatures['serving_default']
    except Exception as e:  # pylint: disable=broad-except
      # A damaged SavedModel fails in many ways (DecodeError, OpError, ...).
      raise UsageError(f'{model_dir} is not a readable personalized model '
                       f'({type(e).__name__}: '
                       f'{" ".join(str(e).split())[:200]})') from e
    input_specs = dict(self._signature.structured_input_signature[1])
    self._local_size = input_specs.pop('local_weights').shape[0]
    # The signature writes the client's theta into the local model's
    # variables, then reads them: two calls at once could each read the
    # other's theta (measured: 1-2 wrong predictions in 1600 calls from 8
    # threads). A SavedModel cannot hold a lock (tf.CriticalSection is not
    # saved), so calls through this server take turns; a model server that
    # loads `personalized/` itself must not run its calls concurrently.
    self._one_call_at_a_time = threading.Lock()
    (self._input_name, self._input_spec), = input_specs.items()

  def check_inputs(self, inputs) -> None:
    """UsageError unless `inputs` fit the serving input's shape and dtype."""
    inputs = np.asarray(inputs)
    spec = self._input_spec
    # NumPy casts bool to any number (True served as movie id 1).
    is_bool = inputs.dtype == np.bool_ and spec.dtype != tf.bool
    if is_bool or not (spec.shape.is_compatible_with(inputs.shape) and
                       np.can_cast(inputs.dtype, spec.dtype.as_numpy_dtype,
                                   casting='same_kind')):
      raise InputError(
          f'inputs of shape {list(inputs.shape)} and dtype {inputs.dtype} do '
          f'not fit the export\'s `{self._input_name}` (shape '
          f'{spec.shape.as_list()}, dtype {spec.dtype.name})')
    if inputs.dtype.kind in 'fc' and not np.all(np.isfinite(inputs)):
      raise InputError(
          f'inputs hold {int(np.sum(~np.isfinite(inputs)))} non-finite '
          'value(s) (NaN or inf); predictions need finite inputs')
    if spec.dtype.is_floating and inputs.dtype.kind == 'f' and inputs.size:
      # The cast would make them inf (with NumPy's overflow warning).
      largest = float(np.finfo(spec.dtype.as_numpy_dtype).max)
      outside = inputs[np.abs(inputs) > largest]
      if outside.size:
        raise InputError(f'inputs hold {outside.size} value(s) beyond '
                         f'{spec.dtype.name} (e.g. {outside[0]})')
    if spec.dtype.is_integer and inputs.size:
      # tf.constant wrapped them: 2**40 became id 0, served as if asked.
      limits = np.iinfo(spec.dtype.as_numpy_dtype)
      outside = inputs[(inputs < limits.min) | (inputs > limits.max)]
      if outside.size:
        raise InputError(f'inputs hold {outside.size} value(s) beyond '
                         f'{spec.dtype.name} (e.g. {outside[0]})')

  def __call__(self, client_id: str, inputs) -> Mapping[str, np.ndarray]:
    """Predictions of `client_id`'s personalized model on serving `inputs`.

    A client without a stored local model gets the initial one, i.e. the
    global model's prediction plus the initial local model's.
    """
    return self.predict(client_id, inputs)[0]

  def predict(self, client_id: str,
              inputs) -> tuple[Mapping[str, np.ndarray], bool]:
    """(`__call__`'s predictions, whether the client has a stored local
    model rather than the initial one)."""
    self.check_inputs(inputs)
    local_weights, own_model = local_weights_for(
        self._export_dir, client_id, self._local_size)
    try:
      with self._one_call_at_a_time:
        outputs = self._signature(**{
            self._input_name: tf.constant(inputs, self._input_spec.dtype),
            'local_weights': tf.constant(local_weights)})
        outputs = {name: value.numpy() for name, value in outputs.items()}
    except tf.errors.InvalidArgumentError as e:
      # E.g. a movie id beyond the embedding table: TF's traceback.
      raise InputError(f'the model cannot take these inputs ('
                       f'{_op_error_detail(e)})') from e
    return outputs, own_model


def serve_personalized(export_dir: str, client_id: str,
                       inputs) -> Mapping[str, np.ndarray]:
  """One-off `PersonalizedServer(export_dir)(client_id, inputs)`."""
  return PersonalizedServer(export_dir)(client_id, inputs)

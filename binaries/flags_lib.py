"""Command-line flags shared by the binaries.

The algorithms' flags are generated from their settings dataclasses
(`tff_algos.algorithms.registry`): one flag per field name, with the field's
default and help; a field several algorithms share is one flag.
"""

import dataclasses
import json
import math
import re
import typing
from typing import Any, Callable, Optional, Union

from absl import flags

from binaries import app
from pipeline import run_directory
from pipeline import tff_runtime
from pipeline.errors import UsageError
from tasks import base as task_base
from tasks import registry as task_registry
from tff_algos.aggregation import accounting
from tff_algos.aggregation import factories
from tff_algos.algorithms import registry as algorithm_registry
from tff_algos.algorithms import settings as settings_lib

# Experiment.
flags.DEFINE_string('task', None, 'Task name, e.g. celeba_smile.')
flags.DEFINE_string('algorithm', None, 'Algorithm name, e.g. fedavg.')
flags.DEFINE_string('experiment_name', None, 'Name of the run directory.')
flags.DEFINE_string('root_output_dir', 'runs', 'Root of all run directories.')
flags.DEFINE_integer('total_rounds', 10, 'Rounds to train (resumes if more).')
flags.DEFINE_integer('clients_per_round', 10,
                     'Clients sampled per round (default: the task\'s, e.g. '
                     'all clients for cifar10/cifar100, 20% for emnist; '
                     'otherwise 10, or all clients of a smaller '
                     'population).')
flags.DEFINE_integer('rounds_per_eval', 1, 'Evaluate every this many rounds.')
flags.DEFINE_integer('rounds_per_checkpoint', 5,
                     'Checkpoint every this many rounds (and, at a Ctrl-C, '
                     'the newest finished round).')
# NumPy's legacy global seed (set with TF's) takes 32 bits.
flags.DEFINE_integer('seed', 0, 'Seed of initialization, sampling, data and '
                     'the aggregators\' random draws (DP noise: a released '
                     'model keeps its epsilon only if the seed is secret).',
                     lower_bound=0, upper_bound=2**32 - 1)
flags.DEFINE_string('client_state_dir', None,
                    'Directory of the per-client states (SCAFFOLD/FedPVR c_i, '
                    'FedRes theta_i), written by the clients\' computations '
                    '(default: <run dir>/client_states; remote workers need a '
                    'path they share).')
flags.DEFINE_integer('clients_per_group', 0,
                     'Clients that one compiled computation runs in sequence '
                     '(a TFF client stands for a group); 0: chosen from the '
                     'cohort and the cores.')
flags.DEFINE_enum('runtime', 'tff', ['tff', 'native'],
                  'Execution runtime: tff (TFF\'s C++ runtime) or native (the '
                  'same TF functions run in-process in TF, so TF places them '
                  'on a GPU if there is one).')
flags.DEFINE_enum('batched_cohorts', 'auto', ['auto', 'on', 'off'],
                  'Native runtime: run a group\'s clients side by side over a '
                  'client axis (auto: when TF sees a GPU) or one after '
                  'another (FedAvg/FedProx with SGD on Dense models; others '
                  'run one after another).')
flags.DEFINE_integer('max_concurrent_computation_calls', -1,
                     'Cap on concurrent calls in the TFF C++ runtime '
                     '(<= 0: no cap).')
flags.DEFINE_integer('num_workers', 1,
                     'Local TFF worker processes; > 1 splits each round\'s '
                     'clients over them (TFF\'s mergeable execution context).')
flags.DEFINE_integer('num_subrounds', 0,
                     'Split each round\'s clients into this many sub-rounds, '
                     'run one after another on each worker and merged (TFF\'s '
                     'mergeable execution context): a worker holds one '
                     'sub-round\'s client values at a time, which bounds its '
                     'memory at large cohorts. 0: one sub-round per worker.')
flags.DEFINE_string('worker_addresses', '',
                    'host:port,... of running TFF workers (worker_binary '
                    '--port=N) to split each round\'s clients over, instead '
                    'of local workers.')

# Data.
flags.DEFINE_integer('client_steps', None,
                     'Local steps K per round; unset: --client_epochs passes.')
flags.DEFINE_integer('client_epochs', 1, 'Local epochs when K is unset.')
flags.DEFINE_integer('client_batch_size', 5, 'Client batch size.')
flags.DEFINE_integer('eval_batch_size', 256, 'Evaluation batch size.')
flags.DEFINE_boolean('use_synthetic_data', False,
                     'Use small synthetic data with the real element structure.')
flags.DEFINE_string('cache_dir', None, 'Directory of TFF dataset files.')
flags.DEFINE_string('data_dir', None, 'TFDS data directory.')
flags.DEFINE_boolean('download', False,
                     'Allow downloading a missing dataset into --cache_dir.')
flags.DEFINE_string('movielens_dir', None,
                    'Directory of MovieLens files (movielens: ML-1M ratings.dat or '
                    'ML-100K u.data; movielens_ratings: ML-100K u.data, '
                    'u.item).')
flags.DEFINE_float('heterogeneity', 1.0,
                   'fedres_logistic: alpha of [FedRes] eq. 13 in [0, 1]; 0 '
                   'gives every client the same distribution.')
flags.DEFINE_string('celeba_mode', 'mixed',
                    'celeba_smile: mixed (federated smiling / central '
                    'non-smiling), fl_only (the federated smiling data alone), '
                    'oracle (both labels on the composite clients) or '
                    'federated (both labels on the raw clients).')
# Task options of the re-partitioned tasks (emnist, digits, cifar10/100);
# unset ones take each task's own default.
flags.DEFINE_integer('num_clients', None,
                     'Clients the pooled data is dealt to (default: the '
                     'task\'s: 100 for emnist/digits, 10 for cifar).')
flags.DEFINE_float('similarity', None,
                   'emnist/digits: s, the percentage of i.i.d. data per '
                   'client (the rest label-sorted shards), in [0, 100] '
                   '(default 0).')
flags.DEFINE_float('l2_regularization', None,
                   'digits: lambda of the L2 penalty (lambda / 2) * '
                   '||kernel||^2 of every kernel (Dense and conv), added to '
                   'the training loss and to eval loss (>= 0; default 0).')
flags.DEFINE_float('dirichlet_alpha', None,
                   'cifar10/cifar100: concentration of the Dirichlet label '
                   'partition (small: skewed clients; default 0.1).')
flags.DEFINE_string('model', None,
                    'Model of the task (digits: logistic|mlp|cnn; emnist: '
                    'logistic|mlp; '
                    'cifar10/100: vgg11|resnet8); default: the task\'s.')
flags.DEFINE_float('model_width', 1.0,
                   'Multiplier of layer widths (MLP hidden units, conv '
                   'channels); < 1 for small test models.')
flags.DEFINE_boolean('emnist_only_digits', False,
                     'emnist: the 10-digit split instead of all 62 classes.')
flags.DEFINE_integer('char_embedding_dim', None,
                     'stackoverflow_char: character embedding size (default '
                     '256).')
flags.DEFINE_integer('gru_units', None,
                     'stackoverflow_char: GRU units (default 1024).')
flags.DEFINE_integer('word_vocab_size', None,
                     'stackoverflow_word: most frequent words in the '
                     'vocabulary (default 10000).')
flags.DEFINE_integer('max_eval_sequences', None,
                     'stackoverflow_char/_word: evaluation sequences per '
                     'source (default 5000 / 10000; the real test splits are '
                     'huge).')
flags.DEFINE_integer('movielens_embedding_dim', None,
                     'movielens: width d of the shared movie embedding '
                     '(default 16).')
flags.DEFINE_integer('movielens_context_length', None,
                     'movielens: movies in an example\'s context bag, the '
                     'latest before the label (default 10).')
flags.DEFINE_boolean('spreadout_on_clients', False,
                     'movielens: add the spreadout regularizer of the full '
                     'embedding table to every client\'s loss (default: on '
                     'for non-mixed algorithms, the baseline; off for mixed '
                     'FL, which computes it at the server).')
flags.DEFINE_float('spreadout_weight', 1.0,
                   'movielens: weight of the spreadout term in the client '
                   'loss with --spreadout_on_clients (1 = w_c / w_f of the '
                   'mixed objective with the paper\'s w_f = w_c).')

# Model-update aggregation (tff_algos/aggregation/factories.py).
flags.DEFINE_enum('aggregator', factories.MEAN, factories.NAMES,
                  'How the clients\' model updates are aggregated (as '
                  'tff.learning\'s aggregators): mean (default), robust '
                  '(clipping and zeroing), dp (Gaussian differential privacy), '
                  'compression (quantized updates) or secure (secure sum). '
                  'Any but mean needs --runtime=tff.')
flags.DEFINE_float('clip_norm', None,
                   'robust/compression/secure: L2 clip of a client\'s update '
                   '(unset: tff.learning\'s adaptive norm; inf: no clipping); '
                   'dp: the fixed clip the noise is scaled to (required).')
flags.DEFINE_boolean('zeroing', None,
                     'robust/compression/secure: zero out updates of extreme '
                     'norm (tff.learning\'s adaptive zeroing; default: on). '
                     'Not with dp: the DP guarantee does not cover its '
                     'noise-free threshold.')
flags.DEFINE_float('dp_noise_multiplier', None,
                   'dp: Gaussian noise stddev over --clip_norm (required).')
flags.DEFINE_integer('dp_clients_per_round', None,
                     'dp: denominator of the DP mean (default: '
                     '--clients_per_round).')
flags.DEFINE_float('dp_target_delta', None,
                   'dp: delta of the epsilon logged every round (default: '
                   '1 / the number of train clients).')
flags.DEFINE_integer('compression_bits', 8,
                     'compression: bits of the uniform quantization.')
AGGREGATOR_FLAGS = ('clip_norm', 'zeroing', 'dp_noise_multiplier',
                    'dp_clients_per_round', 'dp_target_delta',
                    'compression_bits')

# Algorithm settings: one flag per field of the algorithms' settings classes.


def _settings_fields() -> dict[str, dataclasses.Field]:
  fields = {}
  for name in algorithm_registry.NAMES:
    for field in dataclasses.fields(algorithm_registry.settings_class(name)):
      seen = fields.get(field.name)
      if seen is not None and (
          (seen.default, seen.type, seen.metadata) != (
              field.default, field.type, field.metadata) and
          not (_default_per_algorithm(field) and
               (seen.type, seen.metadata) == (field.type, field.metadata))):
        raise TypeError(f'setting {field.name} differs between algorithms')
      fields[field.name] = field
  return fields


def _default_per_algorithm(field: dataclasses.Field) -> bool:
  return field.metadata.get(settings_lib.DEFAULT_PER_ALGORITHM, False)


def _algorithm_defaults(setting: str) -> str:
  """'fedavg: x, scaffold: y, ...' of a setting whose default is each
  algorithm's."""
  return ', '.join(
      f'{name}: {field.default}' for name in algorithm_registry.NAMES
      for field in dataclasses.fields(algorithm_registry.settings_class(name))
      if field.name == setting)


def _define_setting_flag(field: dataclasses.Field) -> None:
  kind = field.type
  if typing.get_origin(kind) is Union:  # Optional[int] and the like.
    kind, = [t for t in typing.get_args(kind) if t is not type(None)]
  define = {bool: flags.DEFINE_boolean, int: flags.DEFINE_integer,
            float: flags.DEFINE_float, str: flags.DEFINE_string}[kind]
  if _default_per_algorithm(field):
    define(field.name, None, f'{field.metadata["help"]} Default: the '
           f'algorithm\'s ({_algorithm_defaults(field.name)}).')
  else:
    define(field.name, field.default, field.metadata['help'])


_SETTINGS_FIELDS = _settings_fields()
for _field in _SETTINGS_FIELDS.values():
  _define_setting_flag(_field)

# Flags that only some algorithms use; each algorithm accepts its settings'.
ALGORITHM_FLAGS = tuple(_SETTINGS_FIELDS)

# Flags whose infinity means something (--clip_norm=inf: no clipping); NaN
# is still refused, and the aggregator settings check the rest.
_INFINITY_ALLOWED = ('clip_norm',)
# Batch sizes beyond int32 overflow TF's shape arithmetic in the worker,
# which then crashes and restarts forever; model sizes beyond it failed
# with tracebacks of TF's int32 shapes.
_INT32_SIZE_FLAGS = ('client_batch_size', 'eval_batch_size',
                     'central_batch_size', 'char_embedding_dim', 'gru_units',
                     'word_vocab_size', 'movielens_embedding_dim',
                     'movielens_context_length')
_MAX_INT32_SIZE = 2**31 - 1
# Settings become float32 constants of the computations; TFF refuses a
# larger finite value with a traceback (--clip_norm=1e300).
_MAX_FLOAT32 = 3.4028234663852886e38
# The smallest positive float32 (subnormal); a value below half of it is 0
# in the computations: --clip_norm=1e-300 clipped every update to zero, and
# a learning rate would train nothing, with status 0. Only flags of float32
# math: --dp_target_delta is for the privacy accounting, in float64.
_MIN_FLOAT32 = 1.401298464324817e-45
_FLOAT32_FLAGS = frozenset(
    name for name, field in _SETTINGS_FIELDS.items()
    if float in (field.type, *typing.get_args(field.type))) | {
        'clip_norm', 'dp_noise_multiplier', 'spreadout_weight'}

for _flag in flags.FLAGS.get_flags_for_module(__name__):
  if _flag.flag_type() == 'float':
    # An infinite or NaN value (learning rate, weight, ...) would train to
    # NaN.
    if _flag.name in _INFINITY_ALLOWED:
      flags.register_validator(
          _flag.name, lambda value: value is None or not math.isnan(value),
          message='must be a number')
    else:
      flags.register_validator(
          _flag.name, lambda value: value is None or math.isfinite(value),
          message='must be a finite number')
    flags.register_validator(
        _flag.name, lambda value: value is None or not math.isfinite(value)
        or abs(value) <= _MAX_FLOAT32,
        message=f'must be at most {_MAX_FLOAT32:.8g} in magnitude (a float32)')
    if _flag.name in _FLOAT32_FLAGS:
      flags.register_validator(
          _flag.name, lambda value: not value or abs(value) >= _MIN_FLOAT32,
          message=f'must be 0 or at least {_MIN_FLOAT32:.2g} in magnitude '
          '(a float32: a smaller value is 0 in the computations)')
  elif _flag.flag_type() == 'int':
    # TF and NumPy take 64-bit integers (absl any Python int).
    flags.register_validator(
        _flag.name, lambda value: value is None or -2**63 <= value < 2**63,
        message='must fit in a 64-bit integer')
    if _flag.name in _INT32_SIZE_FLAGS:
      flags.register_validator(
          _flag.name, lambda value: value is None or value <= _MAX_INT32_SIZE,
          message=f'must be at most {_MAX_INT32_SIZE}')



def refuse_empty(name: str) -> None:
  """An empty value of the path flag `name` (e.g. `--cache_dir=$UNSET`) is
  refused: it silently meant the flag's default."""
  flags.register_validator(
      name, lambda value: value != '',
      message='is empty; name a directory, or leave the flag out for its '
      'default')


def require_utf8(name: str) -> None:
  """The path flag `name` must be UTF-8: TensorFlow's file ops take UTF-8
  paths (a byte of another encoding, e.g. Latin-1, was a TypeError
  traceback once a path reached one)."""
  flags.register_validator(
      name, lambda value: value is None or _is_utf8(value),
      message='is not valid UTF-8, which TensorFlow\'s file operations need; '
      'rename it')


def _is_utf8(text: str) -> bool:
  try:
    text.encode('utf-8')  # Undecodable bytes of argv are lone surrogates.
  except UnicodeEncodeError:
    return False
  return True


for _name in ('client_state_dir', 'cache_dir', 'data_dir', 'movielens_dir'):
  refuse_empty(_name)
for _name in ('experiment_name', 'root_output_dir', 'client_state_dir',
              'cache_dir', 'data_dir', 'movielens_dir'):
  require_utf8(_name)

FLAGS = flags.FLAGS

# Per-task defaults (the papers' settings), used for flags the user does not
# set. A value is a constant or a function of the flags (read after the
# constants are applied, in this order).
TaskDefault = Union[Any, Callable[[flags.FlagValues], Any]]


def _paper_cohort(flag_values: flags.FlagValues) -> int:
  # The papers' S=100; the synthetic stand-ins have 20-60 train clients.
  return 10 if flag_values.use_synthetic_data else 100


def _central_step_of_client_and_server_steps(
    flag_values: flags.FlagValues) -> float:
  # eta_c = eta * eta_s ([MixedFL] App. C.2).
  return flag_values.client_learning_rate * flag_values.server_learning_rate


TASK_DEFAULTS: dict[str, dict[str, TaskDefault]] = {
    # [MixedFL] Table C.2.
    'celeba_smile': {
        'clients_per_round': _paper_cohort,
        'client_batch_size': 5,
        'client_steps': 2,
        'client_learning_rate': 0.01,
        'server_learning_rate': 1.0,
        # |B_c| = K * S * |B_i| for 1-w GT's single central batch, S * |B_i|
        # for each of the K central batches of PT and 2-w GT (Appendix C.2).
        'central_batch_size': (
            lambda f: 1000 if f.algorithm == 'mixed_1wgt' else 500),
        'central_learning_rate': _central_step_of_client_and_server_steps,
        'merge_learning_rate': 1.0,
        'federated_weight': 0.5,
        'central_weight': 0.5,
    },
    # [MixedFL] Table C.2, language model (Sec. 5.2).
    'stackoverflow_char': {
        'clients_per_round': _paper_cohort,
        'client_batch_size': 8,
        'client_steps': 16,
        # 2-w GT diverged above eta=1.0 (Appendix C.2).
        'client_learning_rate': (
            lambda f: 1.0 if f.algorithm == 'mixed_2wgt' else 2.0),
        'server_learning_rate': 1.0,
        # 1-w GT: K * S * |B_i| = 12800 halved "for practical computation
        # reasons"; PT and 2-w GT: S * |B_i| per central step.
        'central_batch_size': (
            lambda f: 6400 if f.algorithm == 'mixed_1wgt' else 800),
        'central_learning_rate': _central_step_of_client_and_server_steps,
        'merge_learning_rate': 1.0,
        'federated_weight': 0.73,
        'central_weight': 0.27,
    },
    # [MixedFL] Table C.2 (movie recommender): S=100, |B_i|=16, K=10,
    # eta=0.5, eta_s=1, eta_c=eta, eta_m=1, w_f=w_c=0.5; the central loss is
    # data-free (spreadout), computed at the server by the mixed algorithms
    # and on the clients by the baseline.
    'movielens': {
        'clients_per_round': _paper_cohort,
        'client_batch_size': 16,
        'client_steps': 10,
        # The baseline (spreadout on clients) optimizes the same objective
        # f = w_f * hinge + w_c * spreadout at the same eta = 0.5, written as
        # hinge + (w_c / w_f) * spreadout (--spreadout_weight=1) at
        # eta * w_f = 0.25; mixed FL scales its gradients by w_f, w_c itself.
        'client_learning_rate': (
            lambda f: 0.5 if (f.algorithm or '').startswith('mixed_')
            else 0.25),
        'server_learning_rate': 1.0,
        'central_learning_rate': _central_step_of_client_and_server_steps,
        'merge_learning_rate': 1.0,
        'federated_weight': 0.5,
        'central_weight': 0.5,
        'spreadout_on_clients': (
            lambda f: not (f.algorithm or '').startswith('mixed_')),
    },
}


# A task default of the key is not applied when the user sets one of these.
_ALTERNATIVE_FLAGS = {'client_steps': ('client_epochs',)}


def apply_task_defaults(task: Optional[str],
                        table: Optional[dict] = None) -> dict[str, Any]:
  """Sets the task's defaults of flags not given on the command line.

  Returns {flag: value} of the defaults applied (for hparams.json).
  """
  defaults = (TASK_DEFAULTS if table is None else table).get(task, {})
  applied = {}
  constants = [(n, v) for n, v in defaults.items() if not callable(v)]
  functions = [(n, v) for n, v in defaults.items() if callable(v)]
  for name, default in constants + functions:
    user_set = (name,) + _ALTERNATIVE_FLAGS.get(name, ())
    if any(FLAGS[flag].present for flag in user_set):
      continue
    value = default(FLAGS) if callable(default) else default
    FLAGS[name].value = value
    applied[name] = value
  return applied


def all_values() -> dict:
  """Every flag this module defines, for hparams.json."""
  return {f.name: f.value for f in FLAGS.get_flags_for_module(__name__)}


# hparams.json's keys that are no flag: which values came from the task's
# defaults (binaries/train.py), the changes allowed on resumes
# (pipeline/run_directory.py), and flags an older version wrote:
# --client_state_store chose where the client states were kept (memory or
# SQLite) until the per-client state files replaced both (2026-11-23,
# e0d08cf/bb51140); it never changed results, and is ignored.
NOT_FLAG_KEYS = frozenset({'task_defaults_applied',
                           run_directory.FLAG_CHANGES_KEY})
RETIRED_FLAGS = frozenset({'client_state_store'})


_JSON_TYPES = {type(None): 'null', bool: 'true/false', int: 'a number',
               float: 'a number', str: 'a string', list: 'a list',
               dict: 'an object'}


def _json_type_misfit(flag: flags.Flag, value: Any) -> Optional[str]:
  """Why `value` is not of the JSON type binaries.train writes for `flag`,
  else None (absl's parsers take a string for any flag, and 1 for True)."""
  number = not isinstance(value, bool)
  if isinstance(flag.parser, flags.BooleanParser):
    fits, wanted = isinstance(value, bool), 'true/false'
  elif isinstance(flag.parser, flags.IntegerParser):
    fits, wanted = number and isinstance(value, int), 'an integer'
  elif isinstance(flag.parser, flags.FloatParser):
    fits, wanted = number and isinstance(value, (int, float)), 'a number'
  else:
    fits, wanted = isinstance(value, str), 'a string'
  if fits or (value is None and flag.default is None):
    return None
  return (f'{_JSON_TYPES.get(type(value), type(value).__name__)} where it '
          f'takes {wanted}')


def blame_stored_value(error: UsageError,
                       stored_in: Optional[str]) -> UsageError:
  """`error`, naming `stored_in` (the run's hparams.json that supplied the
  flags not given: evaluate, export) when the flag it starts with
  (`--name...`) was not given: that value is the file's, not one typed."""
  name = re.match(r'--(\w+)', str(error))
  # A data location's fault is the data's (moved, not prepared).
  if (stored_in and name and name.group(1) in FLAGS and
      not FLAGS[name.group(1)].present and
      name.group(1) not in _DATA_LOCATION_FLAGS):
    return UsageError(f'{stored_in}: {error} (the value this file records: '
                      'it is damaged)')
  return error


def _setting_usage_error(e: settings_lib.SettingError,
                         stored_in: Optional[str]) -> UsageError:
  return blame_stored_value(UsageError(f'--{e}'), stored_in)


def parse_stored(name: str, value: Any, path: str) -> Any:
  """The value of --`name` that hparams.json (at `path`) records;
  UsageError naming the key if no such flag takes it: the file is
  damaged (binaries.train writes each flag's own value)."""
  flag = FLAGS[name]
  try:
    misfit = _json_type_misfit(flag, value)
    if misfit:
      raise TypeError(misfit)
    return None if value is None else flag.parser.parse(value)
  except (ValueError, TypeError) as e:
    raise UsageError(f'{path}: {name}={json.dumps(value)} is not a valid '
                     f'--{name} ({e}): the file is damaged') from e


def check_stored_values(hparams: dict, path: str) -> None:
  """UsageError naming the first key of a run's hparams.json (at `path`)
  that is no flag of this module (nor `NOT_FLAG_KEYS`, `RETIRED_FLAGS`), or
  whose value its flag does not take: the file is damaged. (A resume
  reported a list where a number belongs as a changed flag, and took any
  unknown key.)"""
  known = {f.name for f in FLAGS.get_flags_for_module(__name__)}
  for name, value in sorted(hparams.items()):
    if name in known:
      parse_stored(name, value, path)
    elif name == 'task_defaults_applied' and not isinstance(value, dict):
      raise UsageError(f'{path}: {name} must be an object of the task\'s '
                       f'default flag values, not {json.dumps(value)}: the '
                       'file is damaged')
    elif name not in NOT_FLAG_KEYS | RETIRED_FLAGS:
      raise UsageError(f'{path}: {name!r} is no flag of this pipeline (binaries'
                       '.train writes only flags there): the file is damaged')


# What runs started before a flag existed computed, where that is not the
# flag's default and their stored client states depend on it: a resume
# compares a run whose hparams.json lacks the flag with it. (SCAFFOLD/FedPVR
# kept every c_i dense.)
VALUES_BEFORE_FLAG = {'factored_control_variates': False}


def given_flag_defaults(definition) -> dict:
  """{flag: its default} of the flags given on this command line, and
  `VALUES_BEFORE_FLAG` of those the run's client states depend on: what a
  resume compares them with when the run's hparams.json lacks them (a flag
  not given otherwise takes what this code computes, as the run's did)."""
  given = {f.name: f.default for f in FLAGS.get_flags_for_module(__name__)
           if f.present}
  return {**given, **{k: v for k, v in VALUES_BEFORE_FLAG.items()
                      if k in definition.fixed_on_resume}}


# The TFF runtime's execution settings; the native runtime starts no worker.
TFF_EXECUTION_FLAGS = ('num_workers', 'num_subrounds', 'worker_addresses',
                       'max_concurrent_computation_calls')


def check_runtime_flags() -> None:
  """UsageError for an execution flag of the other runtime, which would
  ignore it (even an impossible value such as --num_workers=0)."""
  if FLAGS.runtime == 'tff':
    if FLAGS['batched_cohorts'].present:
      raise UsageError('--batched_cohorts does not apply to --runtime=tff (it '
                       'chooses how the native runtime runs a group); leave '
                       'it out, or use --runtime=native')
    return
  for name in TFF_EXECUTION_FLAGS:
    if FLAGS[name].present:
      raise UsageError(f'--{name} does not apply to --runtime=native (it '
                       'starts no TFF worker); leave it out, or use '
                       '--runtime=tff')


def _execution_settings() -> dict:
  return dict(max_concurrent_computation_calls=(
      FLAGS.max_concurrent_computation_calls), num_workers=FLAGS.num_workers,
              worker_addresses=tff_runtime.parse_worker_addresses(
                  FLAGS.worker_addresses), num_subrounds=FLAGS.num_subrounds)


def check_execution_flags(clients_per_round: Optional[int]) -> None:
  """UsageError for TFF execution flags no context can take, or that give a
  worker no client of a round of `clients_per_round` (None: not known yet).
  Builds nothing: each worker's context takes file descriptors, and a
  hundred thousand of them ran out before this was checked."""
  tff_runtime.check_execution_settings(**_execution_settings())
  if clients_per_round is not None and (
      1 <= clients_per_round < FLAGS.num_workers):
    # Every worker is a process of its own, started even without a client.
    raise UsageError(f'--num_workers={FLAGS.num_workers} is more than the '
                     f'{clients_per_round} clients of a round '
                     '(--clients_per_round); a worker beyond them gets none')


def configure_execution() -> None:
  """The TFF execution context the flags ask for (README, Several TFF
  workers)."""
  tff_runtime.configure_execution(**_execution_settings())


# Where a task's real data is; synthetic data reads none of them.
_DATA_LOCATION_FLAGS = ('cache_dir', 'data_dir', 'movielens_dir', 'download')


def data_config() -> task_base.DataConfig:
  """The task's data settings from the flags; a data location given with
  --use_synthetic_data is a UsageError (it would be ignored)."""
  if FLAGS.use_synthetic_data:
    given = [name for name in _DATA_LOCATION_FLAGS if FLAGS[name].present]
    if given:
      raise UsageError(f'--{given[0]} does not apply with '
                       '--use_synthetic_data (synthetic data reads no files)')
  if FLAGS['client_steps'].present and FLAGS['client_epochs'].present:
    # K steps replace the epochs: --client_epochs would be ignored.
    raise UsageError('--client_epochs does not apply with --client_steps (K '
                     'local steps replace the passes over the data); pass one '
                     'of them')
  return task_base.DataConfig(
      client_batch_size=FLAGS.client_batch_size,
      client_steps=FLAGS.client_steps,
      client_epochs=FLAGS.client_epochs,
      central_batch_size=FLAGS.central_batch_size,
      # The central model's batches a round (--central_steps, default K):
      # PT and 2-w GT take all, 1-w GT the first only (the stream is lazy,
      # so the others are never built).
      central_steps=FLAGS.central_steps or FLAGS.client_steps or 1,
      eval_batch_size=FLAGS.eval_batch_size,
      seed=FLAGS.seed,
      use_synthetic_data=FLAGS.use_synthetic_data,
      cache_dir=FLAGS.cache_dir,
      data_dir=FLAGS.data_dir,
      download=FLAGS.download,
      options=_task_options())


# Flags passed to tasks as DataConfig.options; each task says which it reads.
TASK_OPTION_FLAGS = (
    'celeba_mode', 'movielens_dir', 'heterogeneity', 'model_width',
    'emnist_only_digits', 'spreadout_on_clients', 'spreadout_weight', 'model',
    'num_clients', 'similarity', 'dirichlet_alpha', 'l2_regularization',
    'char_embedding_dim', 'gru_units', 'word_vocab_size', 'max_eval_sequences',
    'movielens_embedding_dim', 'movielens_context_length')


def _task_options() -> dict:
  """Task options; those left unset (None) take each task's own default.
  A data location the task does not read (--cache_dir with digits) is
  refused with them: it was ignored."""
  app.check_flags_apply(
      f'task={FLAGS.task}', task_registry.options(FLAGS.task) +
      task_registry.data_locations(FLAGS.task),
      tuple(dict.fromkeys(TASK_OPTION_FLAGS + _DATA_LOCATION_FLAGS)))
  return {name: FLAGS[name].value for name in TASK_OPTION_FLAGS
          if FLAGS[name].value is not None}


def apply_built_task_defaults(task: task_base.Task) -> None:
  """Flags whose default depends on the built task, unless given explicitly:
  the task's own cohort (e.g. full participation for cifar), and full
  participation when the population is smaller than the default cohort
  (fedres_toy's 2 clients).

  The resolved value is what hparams.json records, so evaluate/export and a
  resumed run see the same value.
  """
  if FLAGS['clients_per_round'].present:
    return
  if task.default_clients_per_round is not None:
    FLAGS.clients_per_round = task.default_clients_per_round
  FLAGS.clients_per_round = min(FLAGS.clients_per_round,
                                task.num_train_clients)


def require_known_names(stored_in: Optional[str] = None) -> None:
  """UsageError unless --algorithm and --task name registered ones;
  `stored_in`: the hparams.json that supplied those not given."""
  for name, known in (('algorithm', algorithm_registry.NAMES),
                      ('task', task_registry.NAMES)):
    value = FLAGS[name].value
    if value not in known:
      source = (f' (in {stored_in})' if stored_in and not FLAGS[name].present
                else '')
      raise UsageError(f'--{name}={value!r}{source} is unknown; allowed: '
                       f'{", ".join(known)}')


def build_algorithm(task: task_base.Task, stored_in: Optional[str] = None):
  """The round definition of --algorithm on `task` from the flags; a
  setting it cannot take is a UsageError naming the flag (and `stored_in`,
  the hparams.json that supplied the flags not given)."""
  settings = algorithm_settings(FLAGS.algorithm, stored_in)
  try:
    return algorithm_registry.build(FLAGS.algorithm, task, settings)
  except settings_lib.SettingError as e:
    raise _setting_usage_error(e, stored_in) from e


def unused_algorithm_flags(algorithm: str) -> frozenset:
  """The algorithm flags `algorithm` does not read (given, they are
  refused; on a resume, their recorded values are not compared)."""
  used = {f.name for f in dataclasses.fields(
      algorithm_registry.settings_class(algorithm))}
  return frozenset(ALGORITHM_FLAGS) - used


def algorithm_settings(algorithm: str, stored_in: Optional[str] = None):
  """The settings of `algorithm` from the flags; UsageError if impossible
  (`stored_in`: as `build_algorithm`'s)."""
  settings_class = algorithm_registry.settings_class(algorithm)
  app.check_flags_apply(
      f'algorithm={algorithm}',
      tuple(f.name for f in dataclasses.fields(settings_class)),
      ALGORITHM_FLAGS)
  fields = dataclasses.fields(settings_class)
  try:
    settings = settings_class(**{
        f.name: FLAGS[f.name].value for f in fields
        if not (_default_per_algorithm(f) and FLAGS[f.name].value is None)})
  except settings_lib.SettingError as e:
    raise _setting_usage_error(e, stored_in) from e
  for field in fields:
    if _default_per_algorithm(field):
      # hparams.json records the value the run used.
      FLAGS[field.name].value = getattr(settings, field.name)
  return settings


def aggregator_settings(
    task: task_base.Task,
    stored_in: Optional[str] = None) -> factories.AggregatorSettings:
  """The model-update aggregator of the flags; UsageError if impossible
  (`stored_in`: as `build_algorithm`'s).

  Fills the DP defaults that depend on the run (the mean's denominator, the
  accountant's delta) into the flags, so hparams.json records them.
  """
  name = FLAGS.aggregator
  app.check_flags_apply(f'aggregator={name}', factories.FIELDS[name],
                        AGGREGATOR_FLAGS)
  if name != factories.MEAN and FLAGS.runtime == 'native':
    raise UsageError(f'--aggregator={name} runs only under --runtime=tff (its '
                     'tff.aggregators process is a TFF computation); the '
                     'native runtime runs --aggregator=mean')
  if name == factories.SECURE and (FLAGS.num_workers > 1 or
                                   FLAGS.num_subrounds > 1 or
                                   FLAGS.worker_addresses):
    # TFF's mergeable context refuses a secure sum after its merge (an
    # AfterMergeStructureError traceback in the first round).
    raise UsageError('--aggregator=secure runs on one TFF worker: TFF\'s '
                     'secure sum cannot be split over --num_workers, '
                     '--num_subrounds or --worker_addresses')
  if name != factories.MEAN and FLAGS.clients_per_group not in (0, 1):
    raise UsageError(f'--clients_per_group={FLAGS.clients_per_group} does not '
                     f'apply to --aggregator={name}: it aggregates each '
                     'client\'s own update, one client per TFF client')
  if name == factories.DP:
    if FLAGS['client_weighting'].present and (
        FLAGS.client_weighting != 'uniform'):
      raise UsageError(
          f'--client_weighting={FLAGS.client_weighting} does not apply to '
          '--aggregator=dp: its mean is unweighted (each clipped update '
          'counts once); leave the flag out or pass uniform')
    if FLAGS.dp_clients_per_round is None:
      FLAGS.dp_clients_per_round = FLAGS.clients_per_round
    if FLAGS.dp_target_delta is None:
      FLAGS.dp_target_delta = accounting.default_delta(
          task.num_train_clients)
  try:
    return factories.AggregatorSettings(
        noise_seed=FLAGS.seed,
        **{field: FLAGS[field].value
           for field in ('aggregator',) + factories.FIELDS[name]})
  except settings_lib.SettingError as e:
    raise _setting_usage_error(e, stored_in) from e


def fixed_on_resume(definition) -> dict[str, str]:
  """{flag: why} of the flags a run may not change on resume, even with
  --allow_flag_changes: the aggregator's state (its clip and noise, quantile
  estimates and counters) is in the checkpoints, and the privacy a DP run
  logs is accounted over all its rounds with one noise multiplier, clip and
  sampling rate; and those the algorithm's stored client states depend on
  (`RoundDefinition.fixed_on_resume`)."""
  why = ('the checkpoints hold the aggregator\'s state, and a DP run\'s '
         'epsilon covers all its rounds with one noise multiplier, clip and '
         'sampling rate')
  fixed = dict.fromkeys(('aggregator',) + AGGREGATOR_FLAGS, why)
  if FLAGS.aggregator == factories.DP:
    fixed['clients_per_round'] = why
  fixed.update(definition.fixed_on_resume)
  return fixed


def privacy_metrics(settings: factories.AggregatorSettings,
                    task: task_base.Task) -> Optional[Callable[[int], dict]]:
  """round -> {privacy/epsilon: spent after that round}; None without DP."""
  if settings.aggregator != factories.DP:
    return None
  spent = accounting.accounting(
      settings.dp_noise_multiplier, task.num_train_clients,
      FLAGS.clients_per_round, settings.dp_target_delta)
  return lambda round_num: {accounting.EPSILON_METRIC: spent.epsilon(round_num)}


if __name__ == '__main__':
  from pipeline import errors as _errors  # pylint: disable=g-import-not-at-top
  _errors.refuse_to_run_library_module(__spec__)

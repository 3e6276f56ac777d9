"""Every bad input ends with one exact `error: ...` line, exit status 2 (3
for environment faults), and leaves every output as it was.

Each case runs a binary on its own copy of two small runs, as a process of
its own forked from a server that imported the binary once (a binary spends
most of its time importing TensorFlow); the parametrized test checks each
case's outcome.
"""

import concurrent.futures
import contextlib
import dataclasses
import glob
import json
import os
import shutil
import sqlite3
import struct
import subprocess
from typing import Callable, Optional

import numpy as np
import pytest

import fault_testlib as lib

RECOVERY = 'fix that and re-run the same command (what was written before is kept)'
NOT_METRICS = ('; it is not a metrics file of this pipeline: restore it, or '
               'use a new --experiment_name')


@dataclasses.dataclass(frozen=True)
class Paths:
  root: str
  base: str
  fedres: str


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  binary: str
  args: Callable[[Paths], list]
  message: Callable[[Paths], str]
  status: int = 2
  # Changes the copied runs before the command (the damage under test).
  setup: Optional[Callable[[Paths], None]] = None
  # A context the command runs in (e.g. a read-only mount).
  during: Optional[Callable[[Paths], contextlib.AbstractContextManager]] = None
  # The last line of stdout it must print all the same (e.g. the metrics
  # that evaluate could not write).
  last_output: Optional[Callable[[str], bool]] = None


def train_new(*flags):
  return lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=new',
                    f'--root_output_dir={p.root}',
                    *[f(p) if callable(f) else f for f in flags]]


def resume_base(*flags):
  return lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=base',
                    '--total_rounds=4', f'--root_output_dir={p.root}', *flags]


def resume_fedres():
  return lambda p: [*lib.FEDRES_FLAGS, '--experiment_name=fedres',
                    '--total_rounds=3', f'--root_output_dir={p.root}']


def of_base(*flags):
  return lambda p: ['--experiment_name=base', f'--root_output_dir={p.root}',
                    *[f(p) if callable(f) else f for f in flags]]


def write(relative, content):
  def setup(p):
    path = os.path.join(p.root, relative)
    with open(path, 'wb' if isinstance(content, bytes) else 'w') as f:
      f.write(content)
  return setup


def without_hparams_key(run, key):
  def setup(p):
    path = os.path.join(p.root, run, 'hparams.json')
    with open(path) as f:
      hparams = json.load(f)
    del hparams[key]
    with open(path, 'w') as f:
      json.dump(hparams, f)
  return setup


def in_new_directory(directory, name, content):
  def setup(p):
    os.makedirs(os.path.join(p.root, directory))
    write(os.path.join(directory, name), content)(p)
  return setup


def events_file(p):
  return glob.glob(os.path.join(p.base, 'tensorboard', 'events.out.*'))[0]


def second_event_record(p):
  """(the events file, its second record's offset, the file's size)."""
  path = events_file(p)
  with open(path, 'rb') as f:
    data = f.read()
  return path, 16 + struct.unpack('<Q', data[:8])[0], len(data)


def damage_second_event_record(p):
  path, offset, _ = second_event_record(p)
  with open(path, 'rb+') as f:
    f.seek(offset + 8)  # The CRC of its length.
    f.write(b'\xff' * 4)


def damaged_events_message(p):
  path, offset, size = second_event_record(p)
  return (f'{path} is damaged at byte {offset} (record 2) with '
          f'{size - offset} bytes from there: not a cut-off last record, '
          'which is all a killed write leaves; move it out of the run\'s '
          'tensorboard directory to resume without its events')


def renamed_metrics_column(p):
  path = os.path.join(p.base, 'metrics.csv')
  with open(path) as f:
    header, rest = f.read().split('\n', 1)
  with open(path, 'w') as f:
    f.write(header.replace(',train/loss,', ',train/lozz,') + '\n' + rest)


def not_a_state_file(relative):
  """The message refusing `relative` in the FedRes run's store."""
  return lambda p: (
      f'{p.fedres}/client_states/{relative} is not a client-state file (the '
      'store holds only <client id, base64url>.state files in round_<r> '
      f'directories); move it out of {p.fedres}/client_states and re-run the '
      'same command')


def remove(relative):
  def setup(p):
    os.remove(os.path.join(p.root, relative))
  return setup


def without_checkpoints(p):
  # A run with its flags only: no checkpoint, and no lock file either.
  shutil.rmtree(os.path.join(p.base, 'checkpoints'))
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(p.base, '.lock'))


def checkpoints_as_file(p):
  path = os.path.join(p.base, 'checkpoints')
  shutil.rmtree(path)
  with open(path, 'w') as f:
    f.write('not a directory')


def edit_hparams(run='base', **values):
  def setup(p):
    path = os.path.join(p.root, run, 'hparams.json')
    with open(path) as f:
      hparams = json.load(f)
    with open(path, 'w') as f:
      json.dump({**hparams, **values}, f)
  return setup


def replace_with_directory(relative):
  def setup(p):
    os.remove(os.path.join(p.root, relative))
    os.mkdir(os.path.join(p.root, relative))
  return setup


def garble_export(p):
  lib.copy_run(os.path.join(p.base, 'export'), os.path.join(p.root, 'garbled'))
  with open(os.path.join(p.root, 'garbled', 'saved_model.pb'), 'wb') as f:
    f.write(b'garbage')


def copy_fedres_export(p, inputs=np.zeros([2, 10], np.float32)):
  """The FedRes run's export copied to <root>/fedres_export, and `inputs`
  to <root>/inputs.npy; returns the copy's local-model store."""
  lib.copy_run(os.path.join(p.fedres, 'export'),
               os.path.join(p.root, 'fedres_export'))
  np.save(os.path.join(p.root, 'inputs.npy'), inputs)
  return os.path.join(p.root, 'fedres_export', 'local_models.sqlite')


def damaged_local_models(p):
  with open(copy_fedres_export(p), 'wb') as f:
    f.write(b'garbage' * 100)


def corrupted_local_weights(p):
  with contextlib.closing(sqlite3.connect(copy_fedres_export(p))) as db:
    with db:
      db.execute("INSERT OR REPLACE INTO local_models VALUES ('0', "
                 "x'00010203', '')")


def non_finite_inputs(p):
  copy_fedres_export(p, np.array([[np.nan] * 10, [np.inf] * 10], np.float32))


def huge_npy_header(version):
  """Setup of a .npy file whose header (format `version`) claims 40 PB
  (NumPy allocated it first: a MemoryError traceback)."""

  def setup(p):
    copy_fedres_export(p)
    with open(os.path.join(p.root, 'inputs.npy'), 'wb') as f:
      np.lib.format._write_array_header(  # pylint: disable=protected-access
          f, {'descr': '<f4', 'fortran_order': False, 'shape': (10**15, 10)},
          version)
      f.write(np.zeros([2, 10], np.float32).tobytes())

  return setup


def npz_inputs(p):
  copy_fedres_export(p)
  np.savez(os.path.join(p.root, 'inputs.npz'), np.zeros([2, 10], np.float32))


def device_as_inputs(p):
  copy_fedres_export(p)
  os.symlink('/dev/zero', os.path.join(p.root, 'zero.npy'))


def inputs_beyond_float32(p):
  copy_fedres_export(p, np.full([2, 10], 1e300))


def export_with_a_file_of_the_user(p):
  lib.copy_run(os.path.join(p.base, 'export'), os.path.join(p.root, 'mine'))
  write('mine/NOTES.txt', 'mine')(p)


def wrongly_shaped_inputs(p):
  np.save(os.path.join(p.root, 'inputs.npy'), np.zeros([2, 3, 4]))


def bool_inputs(p):
  np.save(os.path.join(p.root, 'inputs.npy'), np.ones([2, 10], bool))


def serve(export_dir, inputs='inputs.npy'):
  """serve_personalized's flags for client 0: `export_dir` and `inputs`
  relative to the root (the FedRes run's export: 'fedres/export')."""
  return lambda p: [f'--export_dir={p.root}/{export_dir}', '--client_id=0',
                    f'--inputs_npy={p.root}/{inputs}']


def lock_held(p):
  return lib.lock_held_by_another_process(p.base)


def read_only_root(p):
  return lib.read_only(p.root)


# The port of the gRPC server `another_grpc_server` runs (set while it runs).
_OTHER_SERVER = {}


@contextlib.contextmanager
def another_grpc_server(p):
  """A gRPC server with no service (not TFF's executor service) on a free
  loopback port, for the case's command (`other_server_address`)."""
  del p
  import grpc  # pylint: disable=g-import-not-at-top
  server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
  _OTHER_SERVER['port'] = server.add_insecure_port('localhost:0')
  server.start()
  try:
    yield
  finally:
    server.stop(None)


def other_server_address(p=None):
  del p
  return f'localhost:{_OTHER_SERVER["port"]}'


CASES = [
    Case('seed_negative', 'train', train_new('--seed=-1'),
         lambda p: 'flag --seed=-1: -1 is not an integer in the range '
         '[0, 4294967295]'),
    Case('seed_2_to_70', 'train', train_new(f'--seed={2**70}'),
         lambda p: f'flag --seed={2**70}: {2**70} is not an integer in the '
         'range [0, 4294967295]'),
    Case('eval_batch_size_0', 'train', train_new('--eval_batch_size=0'),
         lambda p: '--eval_batch_size must be >= 1, got 0'),
    Case('infinite_learning_rate', 'train',
         train_new('--client_learning_rate=inf'),
         lambda p: 'flag --client_learning_rate=inf: must be a finite number'),
    Case('nan_learning_rate', 'train', train_new('--server_learning_rate=nan'),
         lambda p: 'flag --server_learning_rate=nan: must be a finite number'),
    # TFF refused the float32 constant with a traceback.
    Case('clip_norm_beyond_float32', 'train',
         train_new('--aggregator=robust', '--clip_norm=1e300'),
         lambda p: 'flag --clip_norm=1e+300: must be at most 3.4028235e+38 in '
         'magnitude (a float32)'),
    # 0 in float32: every update clipped to zero, status 0.
    Case('clip_norm_below_float32', 'train',
         train_new('--aggregator=robust', '--clip_norm=1e-300'),
         lambda p: 'flag --clip_norm=1e-300: must be 0 or at least 1.4e-45 in '
         'magnitude (a float32: a smaller value is 0 in the computations)'),
    # It trained nothing, status 0.
    Case('learning_rate_below_float32', 'train',
         train_new('--client_learning_rate=1e-50'),
         lambda p: 'flag --client_learning_rate=1e-50: must be 0 or at least '
         '1.4e-45 in magnitude (a float32: a smaller value is 0 in the '
         'computations)'),
    # TFF's AfterMergeStructureError traceback in the first round.
    Case('secure_sum_in_sub_rounds', 'train',
         train_new('--aggregator=secure', '--num_subrounds=2'),
         lambda p: '--aggregator=secure runs on one TFF worker: TFF\'s secure '
         'sum cannot be split over --num_workers, --num_subrounds or '
         '--worker_addresses'),
    Case('learning_rate_beyond_float32', 'train',
         train_new('--client_learning_rate=1e39'),
         lambda p: 'flag --client_learning_rate=1e+39: must be at most '
         '3.4028235e+38 in magnitude (a float32)'),
    # --client_epochs was ignored.
    Case('client_epochs_with_client_steps', 'train',
         train_new('--client_epochs=3'),
         lambda p: '--client_epochs does not apply with --client_steps (K '
         'local steps replace the passes over the data); pass one of them'),
    # An infinite stddev: an overflow warning, then NaN updates.
    Case('dp_noise_beyond_float32', 'train',
         train_new('--aggregator=dp', '--clip_norm=1e30',
                   '--dp_noise_multiplier=1e30'),
         lambda p: "--dp_noise_multiplier times --clip_norm is the noise's "
         'stddev, 1e+60: at most 3.4028235e+38 (a float32)'),
    # An explicit 0 was taken for unset: the default ran silently.
    Case('emnist_num_clients_0', 'train',
         train_new('--task=emnist', '--use_synthetic_data',
                   '--num_clients=0'),
         lambda p: '--num_clients must be >= 1, got 0'),
    Case('movielens_embedding_dim_0', 'train',
         lambda p: ['--task=movielens', '--algorithm=fedavg',
                    '--use_synthetic_data', '--movielens_embedding_dim=0',
                    '--experiment_name=new', f'--root_output_dir={p.root}'],
         lambda p: '--movielens_embedding_dim must be >= 1, got 0'),
    # Its int32 window overflowed: a traceback.
    Case('movielens_context_length_huge', 'train',
         lambda p: ['--task=movielens', '--algorithm=fedavg',
                    '--use_synthetic_data',
                    '--movielens_context_length=2147483647',
                    '--experiment_name=new', f'--root_output_dir={p.root}'],
         lambda p: '--movielens_context_length must be at most 1000000 (the '
         'largest movie id), got 2147483647'),
    Case('positional_argument', 'train', lambda p: [*train_new()(p), 'extra'],
         lambda p: 'unexpected positional arguments: extra (every option is '
         'a --flag)'),
    Case('root_output_dir_is_a_file', 'train',
         lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=new',
                    f'--root_output_dir={p.root}/file'],
         lambda p: f'--root_output_dir={p.root}/file is a file, not a '
         'directory', setup=write('file', 'not a directory')),
    Case('root_output_dir_below_a_file', 'train',
         lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=new',
                    f'--root_output_dir={p.root}/file/runs'],
         lambda p: f'--root_output_dir={p.root}/file/runs cannot be made: '
         f'{p.root}/file is a file, not a directory',
         setup=write('file', 'not a directory')),
    Case('run_directory_is_a_file', 'train',
         lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=file',
                    f'--root_output_dir={p.root}'],
         lambda p: f'{p.root}/file is a file, not a run directory; use another '
         '--experiment_name', setup=write('file', 'not a directory')),
    # Status 3: "cannot be made (File exists); use another
    # --root_output_dir".
    Case('run_directory_a_dangling_link', 'train',
         lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=link',
                    f'--root_output_dir={p.root}'],
         lambda p: f'{p.root}/link is a symbolic link to {p.root}/gone, which '
         'does not exist (or is a loop of links); make its target a '
         'directory, or use another --experiment_name',
         setup=lambda p: os.symlink(f'{p.root}/gone', f'{p.root}/link')),
    Case('client_steps_beyond_int64', 'train',
         train_new(f'--client_steps={2**63}'),
         lambda p: f'flag --client_steps={2**63}: must fit in a 64-bit '
         'integer'),
    # The worker's shape arithmetic overflowed: it crashed and restarted
    # forever.
    Case('client_batch_size_beyond_int32', 'train',
         train_new(f'--client_batch_size={2**63 - 1}'),
         lambda p: f'flag --client_batch_size={2**63 - 1}: must be at most '
         '2147483647'),
    # TF's int32 shapes failed with a traceback.
    Case('char_embedding_dim_beyond_int32', 'train',
         lambda p: ['--task=stackoverflow_char', '--algorithm=fedavg',
                    '--use_synthetic_data', f'--char_embedding_dim={2**40}',
                    '--experiment_name=new', f'--root_output_dir={p.root}'],
         lambda p: f'flag --char_embedding_dim={2**40}: must be at most '
         '2147483647'),
    Case('client_state_dir_is_a_file', 'train',
         train_new('--algorithm=scaffold',
                   lambda p: f'--client_state_dir={p.root}/file'),
         lambda p: f'the client-state store {p.root}/file '
         f'(--client_state_dir) cannot be made: {p.root}/file is a file, not '
         'a directory', setup=write('file', 'not a directory')),
    Case('client_state_dir_below_a_file', 'train',
         train_new('--algorithm=scaffold',
                   lambda p: f'--client_state_dir={p.root}/file/states'),
         lambda p: f'the client-state store {p.root}/file/states '
         f'(--client_state_dir) cannot be made: {p.root}/file is a file, not '
         'a directory', setup=write('file', 'not a directory')),
    # A resume deletes its store's rounds after the checkpoint: another
    # run's files must never be taken for them.
    Case('client_state_dir_in_another_run', 'train',
         train_new('--algorithm=scaffold',
                   lambda p: f'--client_state_dir={p.base}/checkpoints'),
         lambda p: f'the client-state store {p.base}/checkpoints '
         '(--client_state_dir) lies inside the run directory '
         f'{os.path.realpath(p.base)}; give each run a store of its own'),
    Case('client_state_dir_of_another_run', 'train',
         train_new('--algorithm=scaffold',
                   lambda p: f'--client_state_dir={p.base}/client_states'),
         lambda p: f'the client-state store {p.base}/client_states '
         '(--client_state_dir) lies inside the run directory '
         f'{os.path.realpath(p.base)}; give each run a store of its own'),
    Case('client_state_dir_marked_for_another_run', 'train',
         train_new('--algorithm=scaffold',
                   lambda p: f'--client_state_dir={p.root}/store'),
         lambda p: f'the client-state store {p.root}/store '
         '(--client_state_dir) is the store of the run /elsewhere/run; give '
         'each run a store of its own',
         setup=in_new_directory('store', '.owner', '/elsewhere/run\n')),
    Case('client_state_dir_with_other_files', 'train',
         train_new('--algorithm=scaffold',
                   lambda p: f'--client_state_dir={p.root}/store'),
         lambda p: f'the client-state store {p.root}/store '
         '(--client_state_dir) holds files that are not client states (e.g. '
         'notes.txt); give the run an empty or new directory',
         setup=in_new_directory('store', 'notes.txt', 'mine')),
    # Its .owner deleted, another run's store was taken over and emptied.
    Case('client_state_dir_with_states_but_no_owner', 'train',
         train_new('--algorithm=scaffold',
                   lambda p: f'--client_state_dir={p.root}/store'),
         lambda p: f'the client-state store {p.root}/store '
         '(--client_state_dir) holds client states (round_2) but no .owner '
         'file naming this run: it may be another run\'s store. If it is '
         'this run\'s, write the run directory\'s path '
         f'({os.path.realpath(p.root)}/new) into '
         f'{os.path.realpath(p.root)}/store/.owner; otherwise give the run an '
         'empty or new directory',
         setup=in_new_directory('store/round_2', 'AA.state', b'state')),
    # The final export replaced its directory, states and all.
    Case('client_state_dir_in_own_export', 'train',
         train_new('--algorithm=scaffold',
                   lambda p: f'--client_state_dir={p.root}/new/export'),
         lambda p: f'the client-state store {p.root}/new/export '
         '(--client_state_dir) lies inside the run directory '
         f'{os.path.realpath(p.root)}/new but is not its client_states '
         'directory; leave --client_state_dir unset or name a directory '
         'outside the run'),
    Case('client_state_dir_holding_the_run', 'train',
         train_new('--algorithm=scaffold',
                   lambda p: f'--client_state_dir={p.root}'),
         lambda p: f'the client-state store {p.root} (--client_state_dir) '
         f'holds the run directory {os.path.realpath(p.root)}/new; name a '
         'directory of its own'),
    # It was ignored.
    Case('client_state_dir_without_client_states', 'train',
         train_new(lambda p: f'--client_state_dir={p.root}/store'),
         lambda p: '--client_state_dir does not apply to --algorithm=fedavg: '
         'it keeps no per-client state'),
    Case('cache_dir_is_a_file', 'train',
         lambda p: ['--task=celeba_smile', '--algorithm=fedavg',
                    '--experiment_name=new', f'--root_output_dir={p.root}',
                    f'--cache_dir={p.root}/file'],
         lambda p: f'--cache_dir={p.root}/file is a file, not a directory; it '
         'must hold celeba.sqlite (TFF CelebA), or pass --download, or '
         '--use_synthetic_data', setup=write('file', 'not a directory')),
    Case('cache_dir_with_synthetic_data', 'train',
         lambda p: ['--task=celeba_smile', '--algorithm=fedavg',
                    '--experiment_name=new', f'--root_output_dir={p.root}',
                    '--use_synthetic_data', f'--cache_dir={p.root}'],
         lambda p: '--cache_dir does not apply with --use_synthetic_data '
         '(synthetic data reads no files)'),
    Case('experiment_name_dot_dot', 'train',
         lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=..',
                    f'--root_output_dir={p.base}'],
         lambda p: "--experiment_name='..' must be a non-empty name without "
         'path separators, other than "." and ".."'),
    Case('experiment_name_with_a_newline', 'train',
         lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=a\nb',
                    f'--root_output_dir={p.root}'],
         lambda p: "--experiment_name='a\\nb' holds a control character "
         '(e.g. a newline); name the run without one'),
    Case('experiment_name_too_long', 'train',
         lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=' + 'a' * 300,
                    f'--root_output_dir={p.root}'],
         lambda p: '--experiment_name is 300 bytes long; a file name has at '
         'most 255'),
    Case('root_output_dir_empty', 'train',
         lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=new',
                    '--root_output_dir='],
         lambda p: '--root_output_dir is empty; name the directory that holds '
         'the runs'),
    # digits reads scikit-learn's bundled images: it was ignored.
    Case('cache_dir_of_a_task_without_files', 'train',
         train_new(lambda p: f'--cache_dir={p.root}'),
         lambda p: '--cache_dir does not apply to --task=digits (its flags: '
         '--model, --num_clients, --similarity, --dirichlet_alpha, '
         '--l2_regularization)'),
    # An empty path (e.g. --cache_dir=$UNSET) silently meant the default:
    # ~/.tff, or the run's latest checkpoint instead of an export.
    Case('cache_dir_empty', 'train',
         lambda p: ['--task=celeba_smile', '--algorithm=fedavg',
                    '--experiment_name=new', f'--root_output_dir={p.root}',
                    '--cache_dir='],
         lambda p: 'flag --cache_dir=: is empty; name a directory, or leave '
         'the flag out for its default'),
    Case('export_dir_empty', 'evaluate', of_base('--export_dir='),
         lambda p: 'flag --export_dir=: is empty; name a directory, or leave '
         'the flag out for its default'),
    # A byte that is not UTF-8 (e.g. a Latin-1 name) reached TensorFlow's
    # file ops: a TypeError traceback, status 1.
    Case('root_output_dir_not_utf8', 'train',
         lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=new',
                    f'--root_output_dir={p.root}/caf\udce9'],
         lambda p: f'flag --root_output_dir={p.root}/caf\\udce9: is not valid '
         'UTF-8, which TensorFlow\'s file operations need; rename it'),
    Case('client_state_dir_not_utf8', 'train',
         train_new('--algorithm=scaffold',
                   lambda p: f'--client_state_dir={p.root}/\udcff'),
         lambda p: f'flag --client_state_dir={p.root}/\\udcff: is not valid '
         'UTF-8, which TensorFlow\'s file operations need; rename it'),
    Case('export_dir_not_utf8', 'evaluate',
         of_base(lambda p: f'--export_dir={p.root}/\udcff'),
         lambda p: f'flag --export_dir={p.root}/\\udcff: is not valid '
         'UTF-8, which TensorFlow\'s file operations need; rename it'),
    Case('experiment_name_dot', 'evaluate',
         lambda p: ['--experiment_name=.', f'--root_output_dir={p.base}'],
         lambda p: "--experiment_name='.' must be a non-empty name without "
         'path separators, other than "." and ".."'),
    Case('resume_with_a_flag_deleted_from_hparams', 'train',
         resume_base('--client_learning_rate=0.5'),
         lambda p: f'{p.base} was trained with other values of flags that '
         'change results: --client_learning_rate (run: not in hparams.json, '
         'now: 0.5); repeat the run\'s values, use a new --experiment_name, '
         'or pass --allow_flag_changes to continue with the new ones',
         setup=without_hparams_key('base', 'client_learning_rate')),
    Case('resume_with_other_flags', 'train',
         resume_base('--client_learning_rate=0.5', '--seed=1'),
         lambda p: f'{p.base} was trained with other values of flags that '
         'change results: --client_learning_rate (run: 0.01, now: 0.5), '
         '--seed (run: 0, now: 1); repeat the run\'s values, use a new '
         '--experiment_name, or pass --allow_flag_changes to continue with '
         'the new ones'),
    Case('run_in_use', 'train', resume_base(),
         lambda p: f'{p.base} is in use by another process (it holds '
         f'{p.base}/.lock); wait for it to finish, or use another '
         '--experiment_name', during=lock_held),
    Case('hparams_not_utf8', 'train', resume_base(),
         lambda p: f'{p.base}/hparams.json is not UTF-8 text (byte 0)',
         setup=write('base/hparams.json', b'\xff{}')),
    # It was "not found", pointing to --allow_flag_changes.
    Case('hparams_a_directory', 'train', resume_base('--allow_flag_changes'),
         lambda p: f'{p.base}/hparams.json is a directory, not the file of the '
         'run\'s flags: move it away',
         setup=replace_with_directory('base/hparams.json')),
    Case('hparams_a_directory_in_evaluate', 'evaluate', of_base(),
         lambda p: f'{p.base}/hparams.json is a directory, not the file of the '
         'run\'s flags: move it away',
         setup=replace_with_directory('base/hparams.json')),
    Case('hparams_a_list', 'evaluate', of_base(),
         lambda p: f'{p.base}/hparams.json must hold a JSON object of flag '
         'values, not a list', setup=write('base/hparams.json', '[1, 2]')),
    Case('hparams_without_algorithm', 'evaluate', of_base(),
         lambda p: f'{p.base}/hparams.json names no algorithm: it is damaged '
         '(binaries.train writes every flag there)',
         setup=edit_hparams(algorithm=None)),
    Case('hparams_unknown_algorithm', 'export', of_base(),
         lambda p: f"--algorithm='foo' (in {p.base}/hparams.json) is unknown; "
         'allowed: fedavg, fedprox, fedsgd, scaffold, fedpvr, mixed_pt, '
         'mixed_1wgt, mixed_2wgt, fedres_naive, fedres_sgd, fedres_avg',
         setup=edit_hparams(algorithm='foo')),
    # A checkpoint "corrupted or incompatible ... or delete it", or another
    # seed's data silently.
    Case('evaluate_with_another_seed', 'evaluate', of_base('--seed=7'),
         lambda p: f'{p.base} was trained with other values of --seed (run: '
         '0, now: 7); leave them out (the run\'s hparams.json gives them)'),
    Case('export_with_another_task', 'export', of_base('--task=emnist'),
         lambda p: f'{p.base} was trained with other values of --task (run: '
         '"digits", now: "emnist"); leave them out (the run\'s hparams.json '
         'gives them)'),
    Case('evaluate_unknown_algorithm', 'evaluate', of_base('--algorithm=foo'),
         lambda p: "--algorithm='foo' is unknown; allowed: fedavg, fedprox, "
         'fedsgd, scaffold, fedpvr, mixed_pt, mixed_1wgt, mixed_2wgt, '
         'fedres_naive, fedres_sgd, fedres_avg'),
    Case('hparams_flag_changes_not_a_list', 'train',
         resume_base('--allow_flag_changes', '--seed=3'),
         lambda p: f'{p.base}/hparams.json: flag_changes must be a list of '
         'the changes made on earlier resumes, not 5: the file is damaged',
         setup=edit_hparams(flag_changes=5)),
    Case('checkpoints_a_file', 'evaluate', of_base(),
         lambda p: f'{p.base}/checkpoints is a file, not the directory of the '
         "run's checkpoints", setup=checkpoints_as_file),
    Case('checkpoint_with_another_round_name', 'train', resume_base(),
         lambda p: f'{p.base}/checkpoints/round_07 is not a checkpoint name '
         f'this pipeline writes (round_7); move it out of {p.base}/checkpoints',
         setup=lambda p: os.makedirs(os.path.join(p.base, 'checkpoints',
                                                  'round_07'))),
    # It loaded (TFF checks only the nesting); assigning it was a traceback.
    Case('checkpoint_of_another_task', 'evaluate',
         lambda p: ['--experiment_name=fedres', f'--root_output_dir={p.root}',
                    '--task=fedres_toy'],
         lambda p: f'{p.fedres} was trained with other values of --task '
         '(run: "fedres_logistic", now: "fedres_toy"); leave them out (the '
         'run\'s hparams.json gives them)'),
    Case('checkpoint_of_another_task_in_hparams', 'evaluate',
         lambda p: ['--experiment_name=fedres', f'--root_output_dir={p.root}'],
         lambda p: f'checkpoint {p.fedres}/checkpoints/round_2 is corrupted or '
         'incompatible with these flags (a tensor of shape [10] where these '
         'flags make [2]); use the flags it was trained with, or delete it '
         'to resume from an earlier one',
         setup=edit_hparams('fedres', task='fedres_toy')),
    # Another run's store (its .owner names that run) passed the file checks
    # when both runs sampled the same clients: evaluate reported, and export
    # paired this run's model with, the other run's client states.
    *[Case(f'client_state_dir_of_another_run_in_{binary}', binary,
           lambda p: ['--experiment_name=fedres', f'--root_output_dir={p.root}',
                      f'--client_state_dir={p.root}/store'],
           lambda p: f'the client-state store {p.root}/store '
           f'(--client_state_dir) is the store of the run '
           f'{os.path.realpath(p.base)}, not of {p.fedres}; name this run\'s '
           'store',
           setup=lambda p: in_new_directory(
               'store', '.owner', os.path.realpath(p.base) + '\n')(p))
      for binary in ('evaluate', 'export')],
    Case('hparams_wrong_type', 'export', of_base(),
         lambda p: f'{p.base}/hparams.json: seed="abc" is not a valid --seed '
         '(a string where it takes an integer): the file is damaged',
         setup=edit_hparams(seed='abc')),
    # Values of the right type that no setting takes were reported as flags
    # the user had typed.
    Case('hparams_impossible_setting', 'evaluate', of_base(),
         lambda p: f'{p.base}/hparams.json: --client_learning_rate must be a '
         'finite number > 0 (the step size of the client_optimizer), got -1.0 '
         '(the value this file records: it is damaged)',
         setup=edit_hparams(client_learning_rate=-1)),
    Case('hparams_impossible_aggregator_setting', 'export', of_base(),
         lambda p: f'{p.base}/hparams.json: --dp_noise_multiplier is needed by '
         '--aggregator=dp (the value this file records: it is damaged)',
         setup=edit_hparams(aggregator='dp')),
    Case('hparams_impossible_task_option', 'evaluate', of_base(),
         lambda p: f'{p.base}/hparams.json: --num_clients=0 is impossible for '
         '1500 examples (allowed: 1..1500) (the value this file records: it '
         'is damaged)', setup=edit_hparams(num_clients=0)),
    # Both were "other values of flags that change results: --... (run:
    # [1, 2], now: 0.01)", advising --allow_flag_changes.
    Case('resume_with_a_wrong_type_in_hparams', 'train', resume_base(),
         lambda p: f'{p.base}/hparams.json: client_learning_rate=[1, 2] is '
         'not a valid --client_learning_rate (a list where it takes a '
         'number): the file is damaged',
         setup=edit_hparams(client_learning_rate=[1, 2])),
    Case('resume_with_a_bad_neutral_value_in_hparams', 'train', resume_base(),
         lambda p: f'{p.base}/hparams.json: total_rounds="abc" is not a valid '
         '--total_rounds (a string where it takes an integer): the file is '
         'damaged', setup=edit_hparams(total_rounds='abc')),
    # Resumed (and evaluate, export read the run) as if it were not there.
    Case('resume_with_an_unknown_key_in_hparams', 'train', resume_base(),
         lambda p: f'{p.base}/hparams.json: \'client_lerning_rate\' is no flag '
         'of this pipeline (binaries.train writes only flags there): the '
         'file is damaged', setup=edit_hparams(client_lerning_rate=0.5)),
    Case('evaluate_with_an_unknown_key_in_hparams', 'evaluate', of_base(),
         lambda p: f'{p.base}/hparams.json: \'bogus\' is no flag of this '
         'pipeline (binaries.train writes only flags there): the file is '
         'damaged', setup=edit_hparams(bogus=1)),
    # It advised deleting the checkpoint "to resume from an earlier one",
    # which holds FedAvg's state too.
    Case('resume_with_another_algorithm_allowed', 'train',
         resume_base('--allow_flag_changes', '--algorithm=scaffold'),
         lambda p: f'checkpoint {p.base}/checkpoints/round_3 holds a state '
         'that the changed flags cannot continue (ValueError): --algorithm '
         '(run: "fedavg", now: "scaffold"), --client_weighting (run: '
         '"num_examples", now: "uniform"); repeat the run\'s values, or train '
         'with the new ones under a new --experiment_name'),
    Case('metrics_garbage', 'train', resume_base(),
         lambda p: f'{p.base}/metrics.csv does not start with a round_num '
         'column' + NOT_METRICS,
         setup=write('base/metrics.csv', 'garbage\x00,\n1,2\n')),
    Case('metrics_empty', 'train', resume_base(),
         lambda p: f'{p.base}/metrics.csv is empty' + NOT_METRICS,
         setup=write('base/metrics.csv', '')),
    # Accepted: the resumed rows put train/loss into a new last column.
    Case('metrics_renamed_column', 'train', resume_base(),
         lambda p: f'{p.base}/metrics.csv: its header does not name the '
         'columns the run wrote (compared with the events in '
         f'{p.base}/tensorboard): no column train/loss (logged for rounds '
         '1-3); column train/lozz holds values the run did not log; restore '
         'the header, or use a new --experiment_name',
         setup=renamed_metrics_column),
    Case('metrics_a_directory', 'train', resume_base(),
         lambda p: f'{p.base}/metrics.csv is a directory' + NOT_METRICS,
         setup=replace_with_directory('base/metrics.csv')),
    Case('metrics_missing', 'train', resume_base(),
         lambda p: f'{p.base}/metrics.csv is missing, but the run has '
         'checkpoint round 3: the rows of rounds 1-3 are lost; restore the '
         'file, or use a new --experiment_name (the run cannot record those '
         'rounds again)',
         setup=remove('base/metrics.csv')),
    Case('tensorboard_a_file', 'train', resume_base(),
         lambda p: f'{p.base}/tensorboard is a file, not the run\'s '
         'TensorBoard directory: move it away, or use a new --experiment_name',
         setup=lambda p: (shutil.rmtree(os.path.join(p.base, 'tensorboard')),
                          write('base/tensorboard', 'mine')(p))),
    Case('events_damaged_mid_file', 'train', resume_base(),
         damaged_events_message, setup=damage_second_event_record),
    # Each was silently ignored.
    Case('checkpoint_round_with_export_dir', 'evaluate',
         of_base('--checkpoint_round=2',
                 lambda p: f'--export_dir={p.base}/export'),
         lambda p: '--checkpoint_round does not apply with --export_dir (the '
         'export is evaluated, not a checkpoint); pass one of them'),
    Case('conformal_alphas_without_conformal', 'evaluate',
         of_base('--conformal_alphas=0.1'),
         lambda p: '--conformal_alphas does not apply without --conformal'),
    Case('checkpoint_round_missing', 'evaluate',
         of_base('--checkpoint_round=7'),
         lambda p: f'--checkpoint_round=7: {p.base}/checkpoints has no '
         'checkpoint of that round (it has rounds 0, 2, 3)'),
    Case('export_of_another_task', 'evaluate',
         of_base(lambda p: f'--export_dir={p.fedres}/export'),
         lambda p: f'--export_dir={p.fedres}/export holds another model than '
         "task digits's (weight shapes 10x2, expected 64x10 10)"),
    Case('garbled_export', 'evaluate',
         of_base(lambda p: f'--export_dir={p.root}/garbled'),
         lambda p: f'--export_dir={p.root}/garbled is not a readable export '
         'of this pipeline (OSError)', setup=garble_export),
    # An IndexError: conformal sets are over one class per example.
    Case('conformal_on_a_regression_task', 'evaluate',
         lambda p: ['--experiment_name=fedres', f'--root_output_dir={p.root}',
                    '--conformal'],
         lambda p: '--conformal needs a classifier of one class per example; '
         '--task=fedres_toy is not one (its loss is QuadraticLinearLoss, not a '
         'cross-entropy)', setup=edit_hparams('fedres', task='fedres_toy')),
    # It served the initial local model, with a note.
    Case('serve_empty_client_id', 'serve_personalized',
         lambda p: [f'--export_dir={p.fedres}/export', '--client_id=',
                    f'--inputs_npy={p.root}/inputs.npy'],
         lambda p: '--client_id is empty; name the client whose local model '
         'to use', setup=copy_fedres_export),
    Case('serve_wrongly_shaped_input', 'serve_personalized',
         serve('fedres/export'),
         lambda p: f'--inputs_npy={p.root}/inputs.npy: inputs of shape '
         '[2, 3, 4] and dtype float64 do not fit the export\'s `features` '
         '(shape [None, 10], dtype float32)', setup=wrongly_shaped_inputs),
    # Served as ones (NumPy casts bool to any number).
    Case('serve_bool_inputs', 'serve_personalized',
         serve('fedres/export'),
         lambda p: f'--inputs_npy={p.root}/inputs.npy: inputs of shape '
         '[2, 10] and dtype bool do not fit the export\'s `features` '
         '(shape [None, 10], dtype float32)', setup=bool_inputs),
    # It "does not exist".
    Case('serve_missing_export', 'serve_personalized',
         serve('fedres/no_export'),
         lambda p: f'--export_dir={p.root}/fedres/no_export is not a '
         'directory (it should be the export of a FedRes run)'),
    Case('serve_input_a_directory', 'serve_personalized',
         serve('fedres/export', 'fedres'),
         lambda p: f'--inputs_npy={p.root}/fedres is a directory, not a .npy '
         'file'),
    Case('serve_empty_input_file', 'serve_personalized',
         serve('fedres/export', 'empty.npy'),
         lambda p: f'--inputs_npy={p.root}/empty.npy is not a .npy array: '
         'No data left in file', setup=write('empty.npy', b'')),
    Case('serve_damaged_local_models', 'serve_personalized',
         serve('fedres_export'),
         lambda p: f'{p.root}/fedres_export/local_models.sqlite is not a '
         'local-model store of a FedRes export (file is not a database)',
         setup=damaged_local_models),
    Case('serve_corrupted_local_weights', 'serve_personalized',
         serve('fedres_export'),
         lambda p: f'{p.root}/fedres_export/local_models.sqlite: the local '
         "model of client '0' is 4 bytes, not 20 float32 values: the file is "
         'damaged', setup=corrupted_local_weights),
    # Their predictions were NaN, printed as JSON no parser accepts.
    Case('serve_non_finite_inputs', 'serve_personalized',
         serve('fedres_export'),
         lambda p: f'--inputs_npy={p.root}/inputs.npy: inputs hold 20 '
         'non-finite value(s) (NaN or inf); predictions need finite inputs',
         setup=non_finite_inputs),
    *(Case(f'serve_huge_npy_header_{version[0]}', 'serve_personalized',
           serve('fedres_export'),
           lambda p: f'--inputs_npy={p.root}/inputs.npy is not a .npy array: '
           'its header declares shape (1000000000000000, 10) of float32 '
           '(40000000000000000 bytes), but it holds 80 bytes of data',
           setup=huge_npy_header(version))
      for version in ((1, 0), (3, 0))),
    # Read as an archive: "inputs of shape [1] and dtype <U1 do not fit".
    Case('serve_npz_inputs', 'serve_personalized',
         serve('fedres_export', 'inputs.npz'),
         lambda p: f'--inputs_npy={p.root}/inputs.npz is not a .npy array: it '
         'is an .npz archive of arrays, not one .npy array',
         setup=npz_inputs),
    # It "did not exist".
    Case('serve_device_inputs', 'serve_personalized',
         serve('fedres_export', 'zero.npy'),
         lambda p: f'--inputs_npy={p.root}/zero.npy is not a regular file',
         setup=device_as_inputs),
    # NumPy's overflow warnings, then "predictions are not finite".
    Case('serve_inputs_beyond_float32', 'serve_personalized',
         serve('fedres_export'),
         lambda p: f'--inputs_npy={p.root}/inputs.npy: inputs hold 20 '
         'value(s) beyond float32 (e.g. 1e+300)',
         setup=inputs_beyond_float32),
    Case('export_into_another_runs_export', 'export',
         of_base(lambda p: f'--export_dir={p.fedres}/export'),
         lambda p: f'--export_dir={p.fedres}/export is inside the directory '
         f'of another run, {os.path.realpath(p.fedres)}; export outside run '
         'directories'),
    Case('export_over_a_file_of_the_user', 'export',
         of_base(lambda p: f'--export_dir={p.root}/mine'),
         lambda p: f'--export_dir={p.root}/mine holds NOTES.txt, which is not '
         'part of an export of this pipeline: replacing the export would lose '
         'it; move it away, or choose a new or empty directory',
         setup=export_with_a_file_of_the_user),
    Case('export_over_the_run', 'export',
         of_base(lambda p: f'--export_dir={p.base}'),
         lambda p: f'--export_dir={p.base} would replace the run directory '
         f'{p.base} (or a directory holding it); choose a new directory'),
    Case('export_over_the_output_root', 'export',
         of_base(lambda p: f'--export_dir={p.root}'),
         lambda p: f'--export_dir={p.root} would replace the run directory '
         f'{p.base} (or a directory holding it); choose a new directory'),
    Case('export_into_checkpoints', 'export',
         of_base(lambda p: f'--export_dir={p.base}/checkpoints'),
         lambda p: f'--export_dir={p.base}/checkpoints is inside the run '
         f'directory {p.base}; export to its export/ (the default) or outside '
         'it'),
    Case('export_over_another_run', 'export',
         of_base(lambda p: f'--export_dir={p.fedres}'),
         lambda p: f'--export_dir={p.fedres} holds a run (checkpoints, '
         'metrics.csv, hparams.json); choose a new directory'),
    # Refused after the run is locked: the lock file and the empty
    # directories made meanwhile are removed again.
    Case('foreign_events_file_in_a_new_run', 'train', train_new(),
         lambda p: f'{p.root}/new/tensorboard/events.out.tfevents.1.host is '
         'not a TensorBoard events file (its first record is not an event); '
         'move it out of the run\'s tensorboard directory '
         'to resume without its events',
         setup=lambda p: (os.makedirs(f'{p.root}/new/tensorboard'),
                          write('new/tensorboard/events.out.tfevents.1.host',
                                b'not events' * 9)(p))),
    Case('unreachable_worker_address', 'train',
         train_new('--worker_addresses=localhost:1'),
         lambda p: '--worker_addresses: no TFF worker answers at localhost:1 '
         'within 10 s (start one there with `worker_binary --port=PORT`)',
         status=3),
    # It accepts the connection: the round's first call then failed with
    # UNIMPLEMENTED and a traceback (status 1).
    Case('worker_address_of_another_grpc_server', 'train',
         train_new(lambda p: f'--worker_addresses={other_server_address()}'),
         lambda p: f'--worker_addresses: the server at '
         f'{other_server_address()} is not a TFF worker (it does not know '
         'TFF\'s executor service); start one there with `worker_binary '
         '--port=PORT`', status=3, during=another_grpc_server),
    # Both were called "not host:port".
    Case('worker_address_port_beyond_65535', 'train',
         train_new('--worker_addresses=localhost:70000'),
         lambda p: "--worker_addresses: the port of 'localhost:70000' is out "
         'of range (1-65535)'),
    Case('worker_address_port_0', 'train',
         train_new('--worker_addresses=localhost:8000,localhost:0'),
         lambda p: "--worker_addresses: the port of 'localhost:0' is out of "
         'range (1-65535)'),
    # Each started a worker process: 20 for a round of 5 clients.
    Case('more_workers_than_clients', 'train', train_new('--num_workers=6'),
         lambda p: '--num_workers=6 is more than the 5 clients of a round '
         '(--clients_per_round); a worker beyond them gets none'),
    # Checked only after a context a worker was built: out of file
    # descriptors, tracebacks (EMFILE) and status 1.
    Case('far_more_workers_than_clients', 'train',
         train_new('--num_workers=100000'),
         lambda p: '--num_workers=100000 is more than the 5 clients of a '
         'round (--clients_per_round); a worker beyond them gets none'),
    # The native runtime ignored them, impossible values too.
    Case('num_workers_with_the_native_runtime', 'train',
         train_new('--runtime=native', '--num_workers=0'),
         lambda p: '--num_workers does not apply to --runtime=native (it '
         'starts no TFF worker); leave it out, or use --runtime=tff'),
    Case('worker_addresses_with_the_native_runtime', 'train',
         train_new('--runtime=native', '--worker_addresses=garbage'),
         lambda p: '--worker_addresses does not apply to --runtime=native (it '
         'starts no TFF worker); leave it out, or use --runtime=tff'),
    Case('batched_cohorts_with_the_tff_runtime', 'train',
         train_new('--batched_cohorts=on'),
         lambda p: '--batched_cohorts does not apply to --runtime=tff (it '
         'chooses how the native runtime runs a group); leave it out, or use '
         '--runtime=native'),
    Case('worker_addresses_without_a_worker', 'train',
         train_new('--worker_addresses=,,,'),
         lambda p: "--worker_addresses=',,,' names no worker (host:port,"
         'host:port; empty runs locally)'),
    Case('worker_address_with_a_scheme', 'train',
         train_new('--worker_addresses=http://localhost:8000'),
         lambda p: "--worker_addresses: 'http://localhost:8000' is not "
         'host:port (e.g. localhost:8000)'),
    # The kernel makes no directories in /proc (ENOENT, not EROFS).
    Case('run_directory_cannot_be_made', 'train',
         lambda p: [*lib.DIGITS_FLAGS, '--experiment_name=new',
                    '--root_output_dir=/proc/no_run_here'],
         lambda p: '/proc/no_run_here/new cannot be made (No such file or '
         'directory); use another --root_output_dir', status=3),
    Case('read_only_new_run', 'train', train_new(),
         lambda p: f'{p.root}/new: Read-only file system; {RECOVERY}',
         status=3, during=read_only_root),
    Case('read_only_resume', 'train', resume_base(),
         lambda p: f'{p.base}/.lock: Read-only file system; {RECOVERY}',
         status=3, during=read_only_root),
    # Checked before the run directory is locked: the store comes first.
    Case('read_only_resume_with_a_store', 'train', resume_fedres(),
         lambda p: f'{p.fedres}/client_states: Read-only file system; '
         f'{RECOVERY}', status=3, during=read_only_root),
    # A resume stopped at '<path>: Is a directory' / 'Not a directory'.
    Case('directory_in_a_client_state_round', 'train', resume_fedres(),
         not_a_state_file('round_2/mine'),
         setup=lambda p: os.makedirs(f'{p.fedres}/client_states/round_2/mine',
                                     exist_ok=True)),
    # A resume deleted it with the round after the checkpoint.
    Case('file_of_the_user_in_a_client_state_round', 'train', resume_fedres(),
         not_a_state_file('round_3/notes.txt'),
         setup=in_new_directory('fedres/client_states/round_3', 'notes.txt',
                                'mine')),
    Case('file_named_as_a_client_state_round', 'train', resume_fedres(),
         not_a_state_file('round_9'),
         setup=write('fedres/client_states/round_9', 'mine')),
    # Both made an empty checkpoints/ (TFF's manager), export a .lock too.
    Case('evaluate_without_checkpoints', 'evaluate', of_base(),
         lambda p: f'{p.base}/checkpoints has no checkpoint',
         setup=without_checkpoints),
    Case('export_without_checkpoints', 'export', of_base(),
         lambda p: f'{p.base}/checkpoints has no checkpoint',
         setup=without_checkpoints),
    # Its metrics were computed, then lost with the write.
    Case('read_only_evaluate', 'evaluate', of_base(),
         lambda p: f'{p.base}/evaluation_round_3.json: Read-only file system; '
         f'{RECOVERY}', status=3, during=read_only_root,
         last_output=lambda line: json.loads(line)['checkpoint_round'] == 3),
    # /proc exists, but the kernel makes no directory in it: a traceback.
    Case('export_where_no_directory_can_be_made', 'export',
         of_base('--export_dir=/proc/export'),
         lambda p: '/proc/export cannot be written: no directory can be made '
         'in /proc (No such file or directory); export to another directory '
         '(--export_dir)', status=3),
    Case('read_only_export', 'export', of_base(),
         lambda p: f'{p.base}: Read-only file system; {RECOVERY}', status=3,
         during=read_only_root),
]


@dataclasses.dataclass(frozen=True)
class Outcome:
  paths: Paths
  result: subprocess.CompletedProcess
  digest_before: str
  digest_after: str


def run_case(case: Case, binary, runs, directory) -> Outcome:
  root = directory / 'root'
  paths = Paths(str(root), str(root / 'base'), str(root / 'fedres'))
  lib.copy_run(runs / 'base', paths.base)
  lib.copy_run(runs / 'fedres', paths.fedres)
  if case.setup:
    case.setup(paths)
  before = lib.tree_digest(root)
  with case.during(paths) if case.during else contextlib.nullcontext():
    result = binary.run(case.args(paths))
  return Outcome(paths, result, before, lib.tree_digest(root))


def run_cases(binary_name: str, cases: list[Case], runs,
              tmp_path_factory) -> dict[str, Outcome]:
  binary = lib.preloaded(binary_name)
  return {case.name: run_case(case, binary, runs,
                              tmp_path_factory.mktemp(case.name))
          for case in cases}


@pytest.fixture(scope='module')
def outcomes(request, tmp_path_factory):
  """{case name: future of its Outcome} of the cases this session runs."""
  runs = lib.shared_runs(tmp_path_factory)
  names = {item.callspec.params['case'].name
           for item in request.session.items
           if item.module is request.module and hasattr(item, 'callspec')}
  by_binary = {}
  for case in CASES:
    if case.name in names:
      by_binary.setdefault(case.binary, []).append(case)
  futures = {}
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    for binary_name, cases in by_binary.items():
      future = pool.submit(run_cases, binary_name, cases, runs,
                           tmp_path_factory)
      futures.update({case.name: future for case in cases})
  return futures


@pytest.mark.parametrize('case', CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_error_line_and_changes_nothing(outcomes, case):
  # Re-raises a set-up failure.
  outcome = outcomes[case.name].result()[case.name]
  result = outcome.result
  assert result.returncode == case.status, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  assert lib.error_lines(result) == [
      f'error: {case.message(outcome.paths)}'], result.stderr[-3000:]
  assert outcome.digest_after == outcome.digest_before
  if case.last_output:
    assert case.last_output(result.stdout.splitlines()[-1]), result.stdout

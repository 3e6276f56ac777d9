"""Kills training runs at random moments and checks that they resume exactly.

For each algorithm below (SCAFFOLD, FedResAvg, Mixed FL 2-w GT on small
tasks) this trains one uninterrupted reference run, then N interrupted runs
of the same command: each is started and SIGKILLed at a random moment of a
random round after its latest checkpoint (inside the round, while it writes
its metrics row and events, or while it writes its checkpoint), started and
killed again (--kills times in all), then run to completion. An
interrupted run counts as bit-identical when its metrics.csv rows (without
the timing columns), its exported weights (and a FedRes run's personal
models), its TensorBoard scalars and its client-state files (SCAFFOLD's c_i,
FedRes's theta_i: those of the kept checkpoints, name for name and byte for
byte) equal the reference run's, with every round's TensorBoard step written
once. It also checks that no TFF worker and no autograph temp file outlives
a killed run.

  .venv/bin/python scripts/fault_injection.py --trials=3 [--kills=3]
      [--algorithms=scaffold,fedres_avg,mixed_2wgt] [--work_dir=DIR] [--seed=0]
      [--train_flags="--num_workers=2"]

  --signals=kill,term,int,intpg,termpg picks each stop's signal at random
(intpg/termpg: to the run's process group, workers too, as Ctrl-C or
`timeout` sends it); configs beyond the first three: fedpvr, fedres_naive,
fedres_sgd, mixed_pt, mixed_1wgt, fedprox_sgdm, fedavg_dp, fedavg_compression.

Prints one line per algorithm: `<algorithm>: K/N resumed bit-identically`.
Exit status 0 when all did.
"""

import argparse
import collections
import csv
import glob
import hashlib
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# pylint: disable=g-import-not-at-top,wrong-import-position
from pipeline import run_logs
from pipeline import tf_logs

tf_logs.quiet_tensorflow_import()  # This script reads exports with TF.
# pylint: enable=g-import-not-at-top,wrong-import-position

# Small runs with several checkpoints, so kills land before, between and
# inside checkpoint writes.
CONFIGS = {
    'scaffold': ['--task=digits', '--algorithm=scaffold', '--num_clients=20',
                 '--clients_per_round=5', '--client_steps=2',
                 '--rounds_per_checkpoint=2', '--total_rounds=10'],
    'fedres_avg': ['--task=fedres_logistic', '--algorithm=fedres_avg',
                   '--clients_per_round=4', '--rounds_per_checkpoint=2',
                   '--total_rounds=10'],
    'mixed_2wgt': ['--task=celeba_smile', '--algorithm=mixed_2wgt',
                   '--use_synthetic_data', '--clients_per_round=3',
                   '--client_steps=1', '--central_batch_size=16',
                   '--rounds_per_checkpoint=2', '--total_rounds=8'],
}
_DIGITS = ['--task=digits', '--num_clients=20', '--clients_per_round=5',
           '--client_steps=2', '--rounds_per_checkpoint=2',
           '--total_rounds=10']
CONFIGS.update({
    'fedpvr': _DIGITS + ['--algorithm=fedpvr'],
    # The MLP's first kernel keeps its c_i as factors (docs/scaffold.md).
    'scaffold_factored': _DIGITS + ['--algorithm=scaffold', '--model=mlp'],
    'fedres_naive': [f if f != '--algorithm=fedres_avg'
                     else '--algorithm=fedres_naive'
                     for f in CONFIGS['fedres_avg']],
    'fedres_sgd': [f if f != '--algorithm=fedres_avg'
                   else '--algorithm=fedres_sgd' for f in CONFIGS['fedres_avg']],
    'mixed_pt': [f if f != '--algorithm=mixed_2wgt' else '--algorithm=mixed_pt'
                 for f in CONFIGS['mixed_2wgt']],
    'mixed_1wgt': [f if f != '--algorithm=mixed_2wgt'
                   else '--algorithm=mixed_1wgt' for f in CONFIGS['mixed_2wgt']],
    'fedprox_sgdm': _DIGITS + ['--algorithm=fedprox', '--proximal_strength=0.1',
                               '--server_optimizer=sgdm'],
    'fedavg_dp': _DIGITS + ['--algorithm=fedavg', '--aggregator=dp',
                            '--clip_norm=1.0', '--dp_noise_multiplier=0.5'],
    'fedavg_compression': _DIGITS + ['--algorithm=fedavg',
                                     '--aggregator=compression'],
})


def train_command(flags: list[str], run_dir: str) -> list[str]:
  return [sys.executable, '-m', 'binaries.train', *flags,
          f'--experiment_name={os.path.basename(run_dir)}',
          f'--root_output_dir={os.path.dirname(run_dir)}']


def run_to_completion(command: list[str], env: dict) -> float:
  started = time.monotonic()
  result = subprocess.run(command, cwd=REPO, env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, check=False)
  if result.returncode != 0:
    raise RuntimeError(f'{" ".join(command)} failed:\n{result.stderr[-3000:]}')
  return time.monotonic() - started


def workers_of(pid: int) -> list[int]:
  """worker_binary processes whose launcher parent was `pid` (by the
  --port argument TFF passes; checked through /proc)."""
  found = []
  for proc in glob.glob('/proc/[0-9]*'):
    try:
      with open(os.path.join(proc, 'cmdline'), 'rb') as f:
        cmdline = f.read().split(b'\0')
      with open(os.path.join(proc, 'stat')) as f:
        parent = int(f.read().rsplit(')', 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
      continue
    if cmdline and cmdline[0].endswith(b'worker_binary') and parent == pid:
      found.append(int(os.path.basename(proc)))
  return found


def last_round(run_dir: str, since: float) -> int:
  """Round of metrics.csv's last complete row, if written after `since`
  (a resumed run first cuts rows after its checkpoint), else -1."""
  path = os.path.join(run_dir, 'metrics.csv')
  try:
    if os.path.getmtime(path) < since:
      return -1
    with open(path) as f:
      lines = f.read().split('\n')
  except OSError:
    return -1
  complete = [l for l in lines[1:-1] if l]  # The last item is cut off or ''.
  return int(complete[-1].split(',')[0]) if complete else 0


SIGNALS = {'kill': signal.SIGKILL, 'term': signal.SIGTERM,
           'int': signal.SIGINT,
           # To the run's whole process group (its workers too), as Ctrl-C
           # in a terminal or `timeout` sends it: negative numbers here.
           'intpg': -signal.SIGINT, 'termpg': -signal.SIGTERM}


def kill_in_round(command: list[str], env: dict, run_dir: str,
                  target_round: int, round_seconds: float,
                  rng: random.Random,
                  sig: int = signal.SIGKILL) -> list[int]:
  """Starts `command` and SIGKILLs it at a random moment of round
  `target_round` (once the row of the round before is written: inside the
  round, its row and event writes, or its checkpoint write). Returns the
  pids of its TFF workers still alive a second later (should be none)."""
  started = time.time()
  process = subprocess.Popen(command, cwd=REPO, env=env,
                             stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL,
                             start_new_session=sig < 0)
  workers = []
  while process.poll() is None:
    workers = workers_of(process.pid) or workers
    if last_round(run_dir, started) >= target_round - 1:
      time.sleep(rng.uniform(0, round_seconds))
      break
    time.sleep(0.01)
  if process.poll() is None:
    if sig < 0:
      os.killpg(process.pid, -sig)
    else:
      process.send_signal(sig)
  try:
    process.wait(timeout=120)
  except subprocess.TimeoutExpired:
    print(f'  pid {process.pid} ignored signal {sig} for 120 s; SIGKILL',
          flush=True)
    process.kill()
    process.wait()
  if sig != signal.SIGKILL:
    print(f'    {_signal_name(sig)}: exit status {process.returncode}',
          flush=True)
  time.sleep(1.0)
  return [pid for pid in workers if _alive(pid)]


def _signal_name(sig: int) -> str:
  return signal.Signals(abs(sig)).name + (' to the group' if sig < 0 else '')


def latest_checkpoint(run_dir: str) -> int:
  directory = os.path.join(run_dir, 'checkpoints')
  if not os.path.isdir(directory):
    return 0
  rounds = [int(n[len('round_'):]) for n in os.listdir(directory)
            if n[len('round_'):].isdigit()]
  return max(rounds, default=0)


def seconds_per_round(run_dir: str) -> float:
  """Mean wall time of a round of a finished run (training + evaluation)."""
  with open(os.path.join(run_dir, 'metrics.csv'), newline='') as f:
    rows = list(csv.DictReader(f))
  return sum(float(r['round_seconds']) + float(r.get('eval_seconds') or 0)
             for r in rows) / len(rows)


def _alive(pid: int) -> bool:
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except OSError:
    return False


def progress(run_dir: str) -> str:
  """Where a killed run stood: its last metrics row and checkpoint."""
  return f'row {last_round(run_dir, 0)}, ckpt {latest_checkpoint(run_dir)}'


def metrics_rows(run_dir: str) -> list[dict]:
  return run_logs.comparable_rows(os.path.join(run_dir, 'metrics.csv'))


def client_state_files(run_dir: str) -> dict[str, str]:
  """{path under client_states/: digest of its content}."""
  directory = os.path.join(run_dir, 'client_states')
  found = {}
  for root, _, files in os.walk(directory):
    for name in files:
      if name == '.owner':  # driver.STORE_OWNER_FILE: names its run.
        continue
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        found[os.path.relpath(path, directory)] = hashlib.sha256(
            f.read()).hexdigest()
  return found


def unnamed_or_missing_states(run_dir: str) -> list[str]:
  """Round directories of the store whose file count is not the number of
  clients some kept checkpoint names that round's version for: states left
  behind that no checkpoint needs, or missing ones."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  directory = os.path.join(run_dir, 'checkpoints')
  kept = [tf.train.load_checkpoint(
      os.path.join(directory, name, 'variables', 'variables')).get_tensor(
          '_value/client_versions/.ATTRIBUTES/VARIABLE_VALUE')
          for name in os.listdir(directory)
          if name[len('round_'):].isdigit()]
  if not kept or not kept[0].size:
    return []
  versions = np.stack(kept)
  store = os.path.join(run_dir, 'client_states')
  rounds = {int(n[len('round_'):]) for n in os.listdir(store)
            if n.startswith('round_')} | set(versions[versions >= 0].tolist())
  problems = []
  for round_num in sorted(rounds):
    expected = int(np.sum(np.any(versions == round_num, axis=0)))
    path = os.path.join(store, f'round_{round_num}')
    found = len(os.listdir(path)) if os.path.isdir(path) else 0
    if found != expected:
      problems.append(f'round_{round_num} holds {found} states, the kept '
                      f'checkpoints name {expected}')
  return problems


def newest_states(files: dict[str, str]) -> dict[str, str]:
  """{client file name: 'round_<r>/<name> <digest>'} of each client's newest
  version among `client_state_files`' files."""
  newest = {}
  for path, digest in files.items():
    round_dir, name = os.path.split(path)
    round_num = int(round_dir[len('round_'):])
    if name not in newest or round_num > newest[name][0]:
      newest[name] = (round_num, f'{path} {digest}')
  return {name: entry for name, (_, entry) in newest.items()}


def export_arrays(run_dir: str) -> list:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  loaded = tf.saved_model.load(os.path.join(run_dir, 'export'))
  return [v.numpy().tobytes() for v in
          list(loaded.trainable_weights) + list(loaded.non_trainable_weights)]


def personal_models(run_dir: str) -> list:
  path = os.path.join(run_dir, 'export', 'local_models.sqlite')
  if not os.path.exists(path):
    return []
  connection = sqlite3.connect(f'file:{path}?mode=ro', uri=True)
  try:
    return connection.execute(
        'SELECT client_id, local_weights FROM local_models ORDER BY '
        'client_id').fetchall()
  finally:
    connection.close()


def tensorboard_scalars(run_dir: str) -> tuple[dict, list]:
  """({(tag, step): value bytes}, [(tag, step) written more than once])."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tensorflow.core.util import event_pb2  # pylint: disable=g-import-not-at-top
  values = {}
  counts = collections.Counter()
  for path in sorted(glob.glob(os.path.join(run_dir, 'tensorboard', '**',
                                            'events.out.tfevents.*'),
                               recursive=True)):
    for record in tf.data.TFRecordDataset(path):
      event = event_pb2.Event.FromString(record.numpy())
      for value in event.summary.value:
        if value.tag in run_logs.TIMING_COLUMNS:
          continue
        key = (value.tag, event.step)
        counts[key] += 1
        values[key] = value.tensor.SerializeToString()
  return values, sorted(k for k, n in counts.items() if n > 1)


def differences(reference: str, run: str) -> list[str]:
  found = []
  if metrics_rows(reference) != metrics_rows(run):
    found.append('metrics.csv rows differ')
  if export_arrays(reference) != export_arrays(run):
    found.append('exported weights differ')
  if personal_models(reference) != personal_models(run):
    found.append('personal models differ')
  reference_states, states = (client_state_files(reference),
                              client_state_files(run))
  # Each client's newest state is the one the final checkpoint names. Older
  # versions are kept for the kept checkpoints, which differ after a Ctrl-C
  # (it checkpoints the round it stopped after), but a version both stores
  # hold must hold the same bytes.
  differing = sorted(
      {path for path in set(states) & set(reference_states)
       if states[path] != reference_states[path]} |
      (set(newest_states(states).items()) ^
       set(newest_states(reference_states).items())))
  if differing:
    found.append(f'client-state files differ ({len(differing)}, e.g. '
                 f'{differing[0]})')
  found.extend(unnamed_or_missing_states(run))
  reference_scalars, _ = tensorboard_scalars(reference)
  scalars, repeated = tensorboard_scalars(run)
  if repeated:
    found.append(f'{len(repeated)} TensorBoard steps written twice, e.g. '
                 f'{repeated[0]}')
  if scalars != reference_scalars:
    found.append('TensorBoard scalars differ')
  return found


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--trials', type=int, default=3,
                      help='interrupted runs per algorithm (N)')
  parser.add_argument('--kills', type=int, default=3,
                      help='SIGKILLs per interrupted run before it may finish')
  parser.add_argument('--algorithms', default=','.join(CONFIGS))
  parser.add_argument('--work_dir', default=None,
                      help='where runs go (default: a new temp directory, '
                      'removed at the end)')
  parser.add_argument('--seed', type=int, default=0,
                      help='seed of the kill moments')
  parser.add_argument('--train_flags', default='',
                      help='more flags for every run, space-separated (e.g. '
                      '"--num_workers=2")')
  parser.add_argument('--signals', default='kill',
                      help='comma-separated signals to pick from at random '
                      'per stop: kill, term, int, or intpg/termpg (to the '
                      'run\'s process group, as Ctrl-C and timeout send '
                      'them)')
  args = parser.parse_args()
  for flag, names, known in (('--algorithms', args.algorithms, CONFIGS),
                             ('--signals', args.signals, SIGNALS)):
    unknown = [n for n in names.split(',') if n not in known]
    if unknown:
      parser.error(f'{flag}: {unknown[0]!r} is unknown; allowed: '
                   f'{", ".join(known)}')
  signals = [SIGNALS[n] for n in args.signals.split(',')]
  rng = random.Random(args.seed)
  work_dir = args.work_dir or tempfile.mkdtemp(prefix='fault_injection_')
  # A temp dir of its own, to see autograph files a killed run leaves.
  temp_dir = os.path.join(work_dir, 'tmp')
  os.makedirs(temp_dir, exist_ok=True)
  env = {**os.environ, 'TMPDIR': temp_dir,
         'PYTHONPATH': REPO + os.pathsep + os.environ.get('PYTHONPATH', '')}
  all_identical = True
  try:
    for algorithm in args.algorithms.split(','):
      flags = CONFIGS[algorithm] + args.train_flags.split()
      root = os.path.join(work_dir, algorithm)
      reference = os.path.join(root, 'reference')
      run_to_completion(train_command(flags, reference), env)
      total_rounds = len(metrics_rows(reference))
      # A little longer than a round, to also hit the writes after it.
      kill_window = 1.5 * seconds_per_round(reference)
      identical = 0
      for trial in range(args.trials):
        name = f'killed_{trial}'
        run_dir = os.path.join(root, name)
        command = train_command(flags, run_dir)
        survivors = []
        stops = []
        for _ in range(args.kills):
          # A stop after the last round's checkpoint (before the export)
          # leaves no later round to aim at: aim at the last one again.
          target = rng.randint(
              min(latest_checkpoint(run_dir) + 1, total_rounds), total_rounds)
          sig = rng.choice(signals)
          survivors += kill_in_round(command, env, run_dir, target,
                                     kill_window, rng, sig)
          stops.append(f'{_signal_name(sig)} aimed at round {target}: '
                       f'{progress(run_dir)}')
        run_to_completion(command, env)
        found = differences(os.path.join(root, 'reference'),
                            os.path.join(root, name))
        if survivors:
          found.append(f'TFF workers outlived the killed run: {survivors}')
        # Killed runs' private temp dirs go at the next start, the last
        # run's at its exit: nothing may be left.
        leaked = os.listdir(temp_dir)
        if leaked:
          found.append(f'{len(leaked)} temp files left in {temp_dir}, e.g. '
                       f'{leaked[0]}')
        kills = '; '.join(stops)
        if found:
          print(f'  {algorithm} trial {trial} (killed {kills}): '
                + '; '.join(found), flush=True)
        else:
          identical += 1
          print(f'  {algorithm} trial {trial} (killed {kills}): '
                'bit-identical', flush=True)
      print(f'{algorithm}: {identical}/{args.trials} resumed '
            'bit-identically', flush=True)
      all_identical &= identical == args.trials
  finally:
    if args.work_dir is None:
      shutil.rmtree(work_dir, ignore_errors=True)
  return 0 if all_identical else 1


if __name__ == '__main__':
  sys.exit(main())

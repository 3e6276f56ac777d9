"""pfl-research's FedAvg and SCAFFOLD on this project's benchmark workload.

Runs inside the peer venv (benchmarks/peers/setup_pfl_venv.sh), never the
project's: it imports pfl and torch, nothing of the project.

The workload is `benchmarks.rounds`'s: CelebA-shaped synthetic clients
(4..16 examples of 84x84x3 each; a brighter mouth band on smiling faces),
flatten -> Dense(64, relu) -> Dense(1) (1,354,881 parameters), binary
cross-entropy from logits; a population of --population clients, of which
--clients_per_round are drawn uniformly without replacement each round; each
client takes K=--client_steps SGD steps (rate 0.01) of --client_batch_size
examples from its shuffled, repeated examples (so every client processes
K*B examples, as the project's `repeat().batch(B).take(K)` stream does);
example-weighted mean of the deltas, server SGD with rate 1.0. SCAFFOLD is
pfl's (`pfl.algorithm.SCAFFOLD`, Option II, c_i in pfl's disk or in-memory
user-state storage) on the same workload.

One measurement is one process (or one `torchrun` group of --processes
processes) started by this script, which samples the resident memory of
the whole process tree every 0.2 s. The first --warmup_rounds rounds are not
timed (they include pfl's first-round evaluation); the result is the median
of the timed rounds. The last line is

  PFL_RESULT {"algorithm": ..., "seconds_per_round": ..., "peak_rss_mb": ...}

  .peers-venv/bin/python benchmarks/peers/pfl_benchmark.py \\
      --algorithm=fedavg --clients_per_round=10 --rounds=2 --processes=2

With --check_fixture it instead runs the math check for
benchmarks/peers/check_same_math.py: one client with fixed data and initial
weights, --rounds rounds, the weights (and SCAFFOLD's c and c_i) after each
round written to --check_output.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

RESULT_PREFIX = 'PFL_RESULT '
ROUNDS_PREFIX = 'PFL_ROUNDS '
ALGORITHMS = ('fedavg', 'scaffold')
STATE_STORES = ('disk', 'memory')
IMAGE_SHAPE = (84, 84, 3)
HIDDEN_UNITS = 64
CLIENT_LEARNING_RATE = 0.01
SERVER_LEARNING_RATE = 1.0
MIN_EXAMPLES, MAX_EXAMPLES = 4, 16


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--algorithm', default='fedavg', choices=ALGORITHMS)
  parser.add_argument('--state_store', default='disk', choices=STATE_STORES,
                      help="SCAFFOLD: pfl's storage of the c_i.")
  parser.add_argument('--clients_per_round', type=int, default=100)
  parser.add_argument('--population', type=int, default=2000)
  parser.add_argument('--client_steps', type=int, default=2)
  parser.add_argument('--client_batch_size', type=int, default=5)
  parser.add_argument('--rounds', type=int, default=4, help='Timed rounds.')
  parser.add_argument('--warmup_rounds', type=int, default=1,
                      help='Untimed first rounds (>= 1: round 0 evaluates).')
  parser.add_argument('--processes', type=int, default=1,
                      help='pfl worker processes (torchrun, gloo); each '
                      'trains its share of the cohort.')
  parser.add_argument('--threads', type=int, default=0,
                      help='torch threads per process (0: cores / processes).')
  parser.add_argument('--loader_workers', type=int, default=0,
                      help='DataLoader processes per pfl process making the '
                      "users' data ahead (pfl's PyTorchFederatedDataset); 0: "
                      'made in line (FederatedDataset).')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--check_fixture', default=None,
                      help='Math check: .npz of initial weights and data.')
  parser.add_argument('--check_output', default=None,
                      help='Math check: .npz to write the results to.')
  parser.add_argument('--check_swap_correction', action='store_true',
                      help='Math check, SCAFFOLD: apply the drift correction '
                      'as c_i - c instead of pfl\'s c - c_i (see '
                      'swap_scaffold_correction).')
  parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--state_dir', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.check_fixture:
    if not args.check_output:
      parser.error('--check_fixture needs --check_output')
    return args
  if args.rounds < 1 or args.warmup_rounds < 1:
    parser.error('--rounds and --warmup_rounds must be >= 1 (pfl evaluates '
                 'every client in round 0, which must stay untimed)')
  if min(args.clients_per_round, args.population, args.client_steps,
         args.client_batch_size, args.processes) < 1 or min(
             args.threads, args.loader_workers) < 0:
    parser.error('sizes and --processes must be >= 1, --threads and '
                 '--loader_workers >= 0')
  if args.clients_per_round > args.population:
    parser.error(f'--clients_per_round={args.clients_per_round} exceeds '
                 f'--population={args.population}')
  if args.clients_per_round % args.processes:
    # pfl hands process r every processes-th client of the cohort; with a
    # remainder the processes draw different numbers of users per round and
    # their (otherwise identical) samplers fall out of step.
    parser.error(f'--clients_per_round={args.clients_per_round} must be a '
                 f'multiple of --processes={args.processes}')
  if (args.algorithm == 'scaffold' and args.state_store == 'memory' and
      args.processes > 1):
    parser.error("pfl's in-memory user state is per process: with "
                 '--processes > 1 a client drawn by another process than last '
                 'time would restart from c_i = 0; use --state_store=disk')
  return args


def threads_per_process(args) -> int:
  return args.threads or max(1, (os.cpu_count() or 1) // args.processes)


# ------------------------------------------------------------------ parent --


def tree_rss_mb(process) -> float:
  """RSS of `process` and all its descendants, as binaries/process_memory.py
  counts it (not imported: this runs in the peer venv, apart from the
  project's code)."""
  import psutil  # pylint: disable=import-outside-toplevel
  try:
    processes = [process] + process.children(recursive=True)
  except psutil.Error:
    return 0.0
  total = 0
  for p in processes:
    try:
      total += p.memory_info().rss
    except psutil.Error:
      continue
  return total / 2**20


def measure(args, argv) -> dict:
  """Runs one measuring child (group); returns its timings and peak RSS."""
  import psutil  # pylint: disable=import-outside-toplevel
  threads = threads_per_process(args)
  env = dict(os.environ, OMP_NUM_THREADS=str(threads),
             MKL_NUM_THREADS=str(threads))
  state_dir = tempfile.mkdtemp(prefix='pfl_state_')
  child_args = [os.path.abspath(__file__), '--child',
                f'--state_dir={state_dir}'] + argv
  if args.processes == 1:
    command = [sys.executable] + child_args
  else:
    command = [sys.executable, '-m', 'torch.distributed.run', '--standalone',
               f'--nproc_per_node={args.processes}'] + child_args
  started = time.perf_counter()
  child = subprocess.Popen(command, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
  process = psutil.Process(child.pid)
  peak_rss = 0.0
  try:
    while child.poll() is None:
      peak_rss = max(peak_rss, tree_rss_mb(process))
      time.sleep(0.2)
    stdout, stderr = child.communicate()
  finally:
    if child.poll() is None:
      child.kill()
    import shutil  # pylint: disable=import-outside-toplevel
    state_mb = _dir_mb(state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)
  rounds = [l for l in stdout.splitlines() if l.startswith(ROUNDS_PREFIX)]
  if child.returncode or not rounds:
    sys.stderr.write(stderr[-4000:])
    raise SystemExit(f'error: {" ".join(command)} failed '
                     f'(exit {child.returncode})')
  round_seconds = json.loads(rounds[-1][len(ROUNDS_PREFIX):])
  timed = round_seconds[args.warmup_rounds:]
  return dict(
      algorithm=args.algorithm,
      state_store=args.state_store if args.algorithm == 'scaffold' else None,
      clients=args.clients_per_round, processes=args.processes,
      threads=threads, loader_workers=args.loader_workers,
      seconds_per_round=statistics.median(timed),
      round_seconds=round_seconds, peak_rss_mb=round(peak_rss),
      state_dir_mb=round(state_mb),
      wall_seconds=round(time.perf_counter() - started, 1))


def _dir_mb(path: str) -> float:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:
        continue
  return total / 2**20


# ------------------------------------------------------------- pfl (child) --


def build_torch_model():
  import torch  # pylint: disable=import-outside-toplevel

  class CelebaSmileModel(torch.nn.Module):
    """Flatten -> Dense(64, relu) -> Dense(1), images NHWC as the project's."""

    def __init__(self):
      super().__init__()
      inputs = IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
      self.hidden = torch.nn.Linear(inputs, HIDDEN_UNITS)
      self.logit = torch.nn.Linear(HIDDEN_UNITS, 1)

    def forward(self, images):
      flat = images.reshape(images.shape[0], -1)
      return self.logit(torch.relu(self.hidden(flat)))

    def loss(self, images, labels):
      # Keras' BinaryCrossentropy(from_logits=True): mean over the batch.
      return torch.nn.functional.binary_cross_entropy_with_logits(
          self(images), labels)

    @torch.no_grad()
    def metrics(self, images, labels):
      from pfl.metrics import Weighted  # pylint: disable=import-outside-toplevel
      loss = torch.nn.functional.binary_cross_entropy_with_logits(
          self(images), labels, reduction='sum')
      return {'loss': Weighted(loss.item(), len(labels))}

  return CelebaSmileModel()


class ClientData:
  """The synthetic CelebA clients and their K*B-example training streams."""

  def __init__(self, args, rng):
    self._stream_length = args.client_steps * args.client_batch_size
    self._rng = rng  # Shuffles; per process, like a client's round seed.

  @staticmethod
  def examples(user_id: int):
    """A client's 4..16 examples, fixed by its id (noise + a mouth band)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng([user_id, 7])
    n = int(rng.integers(MIN_EXAMPLES, MAX_EXAMPLES + 1))
    smiling = rng.random(n) < 0.5
    images = rng.integers(0, 200, size=(n, *IMAGE_SHAPE), dtype=np.uint8)
    images[smiling, 52:72] += 55
    return images, smiling

  def training_stream(self, user_id: int):
    """Shuffled, repeated, cut to K*B examples: the K batches a client takes."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    images, smiling = self.examples(user_id)
    n = len(images)
    epochs = -(-self._stream_length // n)
    order = np.concatenate([self._rng.permutation(n) for _ in range(epochs)])
    order = order[:self._stream_length]
    x = images[order].astype(np.float32) / 255.0
    y = smiling[order].astype(np.float32)[:, None]
    return x, y


class WithoutReplacementSampler:
  """pfl user sampler: each round's users uniformly without replacement.

  pfl asks for one user at a time; this hands out one fresh draw of
  `cohort` distinct users per round. Every process builds it with the same
  seed and pfl calls it in lockstep on all of them, so they agree.
  """

  def __init__(self, population: int, cohort: int, seed: int):
    import numpy as np  # pylint: disable=import-outside-toplevel
    self._rng = np.random.default_rng(seed)
    self._population, self._cohort = population, cohort
    self._pending = []

  def __call__(self):
    if not self._pending:
      self._pending = list(self._rng.choice(
          self._population, self._cohort, replace=False))
    return int(self._pending.pop(0))


def round_timer():
  from pfl.callback.base import TrainingProcessCallback  # pylint: disable=import-outside-toplevel
  from pfl.metrics import Metrics  # pylint: disable=import-outside-toplevel

  class RoundTimer(TrainingProcessCallback):
    """Wall seconds of each central iteration (sampling to model update)."""

    def __init__(self):
      self.seconds = []
      self._last = None

    def on_train_begin(self, *, model):
      self._last = time.perf_counter()
      return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *,
                                central_iteration):
      now = time.perf_counter()
      self.seconds.append(now - self._last)
      self._last = now
      return False, Metrics()

  return RoundTimer()


def build_algorithm(name: str, population: int, cohort: int, rounds: int,
                    state_store: str, state_dir: str):
  """(algorithm, algorithm params) for FedAvg or SCAFFOLD (Option II)."""
  from pfl.algorithm import FederatedAveraging  # pylint: disable=import-outside-toplevel
  from pfl.algorithm import NNAlgorithmParams  # pylint: disable=import-outside-toplevel
  # Round 0 evaluates every client before and after training: it is a
  # warm-up round; no later round evaluates.
  common = dict(central_num_iterations=rounds, evaluation_frequency=rounds + 1,
                train_cohort_size=cohort, val_cohort_size=0)
  if name == 'fedavg':
    return FederatedAveraging(), NNAlgorithmParams(**common)
  from pfl.algorithm.scaffold import SCAFFOLD, SCAFFOLDParams  # pylint: disable=import-outside-toplevel
  from pfl.data.user_state import DiskUserStateStorage, InMemoryUserStateStorage  # pylint: disable=import-outside-toplevel
  storage = (DiskUserStateStorage(state_dir) if state_store == 'disk'
             else InMemoryUserStateStorage())
  return SCAFFOLD(), SCAFFOLDParams(
      population=population, use_gradient_as_control_variate=False,
      user_state_storage=storage, **common)


def allow_pfl_states_in_torch_load() -> None:
  """Lets pfl's disk user-state storage read back what it wrote.

  pfl 0.6.0 stores a c_i with torch.save and reads it with a bare
  torch.load, whose default since torch 2.6 (weights_only=True) refuses
  pfl's statistics class: the second visit of a client would fail. Allowing
  that one class is torch's documented remedy; it reads the same bytes.
  """
  import torch  # pylint: disable=import-outside-toplevel
  from pfl.stats import MappedVectorStatistics  # pylint: disable=import-outside-toplevel
  torch.serialization.add_safe_globals([MappedVectorStatistics])


def run_pfl(algorithm, params, data, batch_size, initial_weights=None,
            callbacks=()):
  """Trains with pfl's simulator on the federated dataset `data`."""
  import torch  # pylint: disable=import-outside-toplevel
  allow_pfl_states_in_torch_load()
  from pfl.aggregate.simulate import SimulatedBackend  # pylint: disable=import-outside-toplevel
  from pfl.aggregate.weighting import WeightByDatapoints  # pylint: disable=import-outside-toplevel
  from pfl.hyperparam import NNTrainHyperParams  # pylint: disable=import-outside-toplevel
  from pfl.model.pytorch import PyTorchModel  # pylint: disable=import-outside-toplevel
  module = build_torch_model()
  if initial_weights is not None:
    module.load_state_dict(initial_weights)
  model = PyTorchModel(
      model=module, local_optimizer_create=torch.optim.SGD,
      central_optimizer=torch.optim.SGD(module.parameters(),
                                        lr=SERVER_LEARNING_RATE))
  # Example-weighted mean: every client's weight is the examples it
  # processed (its stream of K*B), as in the project's FedAvg.
  backend = SimulatedBackend(training_data=data, val_data=data,
                             postprocessors=[WeightByDatapoints()])
  # One epoch of the K*B stream in batches of B is exactly K steps (pfl's
  # SCAFFOLD takes epochs, not steps; K = epochs * ceil(n/B) there too).
  train_params = NNTrainHyperParams(local_num_epochs=1,
                                    local_learning_rate=CLIENT_LEARNING_RATE,
                                    local_batch_size=batch_size)
  algorithm.run(algorithm_params=params, backend=backend, model=model,
                model_train_params=train_params, callbacks=list(callbacks))


class _UserStreams:
  """A torch map-style dataset whose item `user_id` is that user's stream."""

  def __init__(self, clients: ClientData, population: int):
    self._clients, self._population = clients, population

  def __len__(self):
    return self._population

  def __getitem__(self, user_id):
    import torch  # pylint: disable=import-outside-toplevel
    images, labels = self._clients.training_stream(int(user_id))
    return {'images': torch.from_numpy(images),
            'labels': torch.from_numpy(labels), 'user_id': str(user_id)}


def loader_federated_dataset(clients, sampler, population, workers):
  """pfl's PyTorchFederatedDataset: `workers` DataLoader processes make the
  users' data ahead of training (pfl's way to parallelize preprocessing)."""
  from pfl.data.pytorch import PyTorchFederatedDataset  # pylint: disable=import-outside-toplevel
  # batch_size=None: a user's tensors come whole, not stacked into a batch
  # of users.
  return PyTorchFederatedDataset(_UserStreams(clients, population), sampler,
                                 batch_size=None, num_workers=workers)


def run_child(args) -> None:
  import numpy as np  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(threads_per_process(args))
  from pfl.data.dataset import Dataset  # pylint: disable=import-outside-toplevel
  # Importing pfl's PyTorch model selects PyTorch as pfl's framework (and
  # its distributed context), which pfl's datasets read when built.
  import pfl.model.pytorch  # pylint: disable=import-outside-toplevel,unused-import
  from pfl.internal.ops.selector import get_framework_module  # pylint: disable=import-outside-toplevel
  rank = get_framework_module().distributed.global_rank
  torch.manual_seed(args.seed)  # The same initial model on every process.
  clients = ClientData(args, np.random.default_rng([args.seed, rank]))

  sampler = WithoutReplacementSampler(args.population, args.clients_per_round,
                                      args.seed)
  if args.loader_workers:
    data = loader_federated_dataset(clients, sampler, args.population,
                                    args.loader_workers)
  else:
    from pfl.data.federated_dataset import FederatedDataset  # pylint: disable=import-outside-toplevel
    data = FederatedDataset(
        lambda user_id: Dataset(clients.training_stream(user_id),
                                user_id=str(user_id)), sampler)
  timer = round_timer()
  algorithm, params = build_algorithm(
      args.algorithm, args.population, args.clients_per_round,
      args.warmup_rounds + args.rounds, args.state_store, args.state_dir)
  run_pfl(algorithm, params, data, args.client_batch_size, callbacks=[timer])
  if rank == 0:
    print(ROUNDS_PREFIX + json.dumps(timer.seconds), flush=True)


# -------------------------------------------------------------- math check --


def keras_to_torch(weights: dict) -> dict:
  """The project's Keras kernels are [in, out]; torch's Linear is [out, in]."""
  import torch  # pylint: disable=import-outside-toplevel
  return {
      'hidden.weight': torch.tensor(weights['kernel_0'].T.copy()),
      'hidden.bias': torch.tensor(weights['bias_0']),
      'logit.weight': torch.tensor(weights['kernel_1'].T.copy()),
      'logit.bias': torch.tensor(weights['bias_1']),
  }


def torch_to_keras(tensors: dict, prefix: str) -> dict:
  names = {'hidden.weight': 'kernel_0', 'hidden.bias': 'bias_0',
           'logit.weight': 'kernel_1', 'logit.bias': 'bias_1'}
  out = {}
  for name, value in tensors.items():
    # A copy: parameters and pfl's server c change in place later.
    array = value.detach().cpu().numpy().copy()
    out[f'{prefix}{names[name]}'] = array.T if name.endswith('weight') else array
  return out


def swap_scaffold_correction() -> None:
  """Makes pfl's SCAFFOLD the paper's, with every c and c_i negated.

  pfl 0.6.0 forms c_i+ from the model difference y_i - x where the paper
  (Option II) has x - y_i (Option I likewise stores y - x after a full-batch
  step, i.e. minus the gradient), yet corrects each step by c - c_i as the
  paper does: its control variates are the paper's negated while the
  correction keeps the paper's sign. Swapping the two in the correction
  makes pfl's c, c_i exactly minus the paper's and its models the paper's;
  only the math check uses it, to show that the sign is the one difference.
  """
  import pfl.algorithm.scaffold as scaffold_module  # pylint: disable=import-outside-toplevel
  factory = scaffold_module.bridges

  class SwappedBridge:

    @staticmethod
    def do_control_variate_sgd(model, user_dataset, train_params, local_c,
                               server_c):
      factory.scaffold_bridge().do_control_variate_sgd(
          model, user_dataset, train_params, local_c=server_c,
          server_c=local_c)

  class Factory:

    def __getattr__(self, name):
      return getattr(factory, name)

    @staticmethod
    def scaffold_bridge():
      return SwappedBridge

  scaffold_module.bridges = Factory()


def run_check(args) -> None:
  """One client, fixed data and initial weights; records every round."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from pfl.callback.base import TrainingProcessCallback  # pylint: disable=import-outside-toplevel
  from pfl.data.dataset import Dataset  # pylint: disable=import-outside-toplevel
  import pfl.model.pytorch  # pylint: disable=import-outside-toplevel,unused-import
  from pfl.data.federated_dataset import FederatedDataset  # pylint: disable=import-outside-toplevel
  from pfl.metrics import Metrics  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(1)
  if args.check_swap_correction:
    swap_scaffold_correction()
  fixture = dict(np.load(args.check_fixture))
  population = int(fixture['population'])
  batch_size = int(fixture['batch_size'])
  data = (fixture['images'], fixture['labels'])
  results = {}
  state_dir = tempfile.mkdtemp(prefix='pfl_check_state_')
  algorithm, params = build_algorithm(args.algorithm, population, 1,
                                      int(fixture['rounds']), args.state_store,
                                      state_dir)

  class Recorder(TrainingProcessCallback):

    def after_central_iteration(self, aggregate_metrics, model, *,
                                central_iteration):
      prefix = f'round{central_iteration + 1}/'
      results.update(torch_to_keras(
          dict(model.pytorch_model.named_parameters()), prefix + 'model/'))
      if args.algorithm == 'scaffold':
        results.update(torch_to_keras(
            dict(algorithm._server_c.items()), prefix + 'c/'))  # pylint: disable=protected-access
        local_c = params.user_state_storage.load_state('client0', 'local_c')
        results.update(torch_to_keras(dict(local_c.items()), prefix + 'c_i/'))
      return False, Metrics()

  try:
    run_pfl(algorithm, params,
            FederatedDataset(lambda user_id: Dataset(data, user_id=user_id),
                             lambda: 'client0'), batch_size,
            initial_weights=keras_to_torch(fixture), callbacks=[Recorder()])
  finally:
    import shutil  # pylint: disable=import-outside-toplevel
    shutil.rmtree(state_dir, ignore_errors=True)
  np.savez(args.check_output, **results)
  print(f'pfl {args.algorithm}: {int(fixture["rounds"])} rounds written to '
        f'{args.check_output}', flush=True)


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  if args.check_fixture:
    run_check(args)
  elif args.child:
    run_child(args)
  else:
    record = measure(args, [a for a in argv if not a.startswith('--child')])
    print(f'pfl {record["algorithm"]}'
          + (f' ({record["state_store"]} c_i)' if record['state_store'] else '')
          + f', {record["clients"]} clients, {record["processes"]} process(es)'
          f' x {record["threads"]} thread(s)'
          + (f' + {record["loader_workers"]} loader process(es)'
             if record['loader_workers'] else '') + ': '
          f'{record["seconds_per_round"]:.3f} s/round (rounds: '
          + ', '.join(f'{s:.2f}' for s in record['round_seconds'])
          + f'), peak RSS {record["peak_rss_mb"]} MB, '
          f'{record["wall_seconds"]:.0f} s wall', flush=True)
    print(RESULT_PREFIX + json.dumps(record), flush=True)


if __name__ == '__main__':
  main()

"""FedAvg's and SCAFFOLD's rounds hand-fused (C) and XLA-compiled, and a
float64 reference of their math: the pieces of `benchmarks.fused_floor`
(which documents them), importable without its flags."""

import math
import os
import shutil
import subprocess
import time

from pipeline.errors import EnvironmentFault
from pipeline.errors import UsageError

FLOORS = ('c_memory', 'c_file', 'c_mapped', 'xla', 'xla_file', 'tf_factored')
_PIXELS = 84 * 84 * 3
_HIDDEN = 64
# The benchmark model's trainable variables (benchmarks.rounds).
SHAPES = ((_PIXELS, _HIDDEN), (_HIDDEN,), (_HIDDEN, 1), (1,))
LEARNING_RATE = 0.01  # benchmarks.rounds' client learning rate.
# Of each tensor's own largest value: W1's values are 100x smaller than the
# small tensors', so one bound for the whole vector would let W1 drift. The
# C and XLA rounds are within 6e-5 in float32.
_TOLERANCE = 1e-3
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       'fused_floor.c')


def workload_bytes(clients: int, steps: int, batch: int) -> int:
  """The float32 bytes of a round's inputs: each client's c_i and batches."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  size = sum(int(np.prod(s)) for s in SHAPES)
  return 4 * clients * (size + steps * batch * (_PIXELS + 1))


class Workload:
  """A round's inputs: x, c, each client's c_i and K batches."""

  def __init__(self, clients: int, steps: int, batch: int, seed: int = 0):
    import numpy as np  # pylint: disable=g-import-not-at-top
    rng = np.random.default_rng(seed)
    size = sum(int(np.prod(s)) for s in SHAPES)
    self.clients, self.steps, self.batch = clients, steps, batch
    self.x = rng.standard_normal(size, np.float32) * 0.01
    self.c = rng.standard_normal(size, np.float32) * 0.01
    self.states = rng.standard_normal((clients, size), np.float32) * 0.01
    self.images = rng.random((clients, steps, batch, _PIXELS),
                             dtype=np.float32)
    self.labels = rng.integers(0, 2, (clients, steps, batch)).astype(
        np.float32)

  def write(self, directory: str, states_in_files: bool) -> None:
    """The inputs as raw float32 files; the c_i as states.f32, or one file
    each in states/ (and nowhere else, so that a client must read its
    file)."""
    for name in ('x', 'c', 'images', 'labels'):
      getattr(self, name).tofile(os.path.join(directory, f'{name}.f32'))
    if not states_in_files:
      self.states.tofile(os.path.join(directory, 'states.f32'))
      return
    os.makedirs(os.path.join(directory, 'states'))
    for i, state in enumerate(self.states):
      state.tofile(os.path.join(directory, 'states', str(i)))


def split(flat):
  """A flat weight vector as the model's tensors."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  sizes = [int(np.prod(s)) for s in SHAPES]
  pieces = np.split(flat, np.cumsum(sizes)[:-1])
  return [p.reshape(s) for p, s in zip(pieces, SHAPES)]


def _gradient(w, images, labels):
  import numpy as np  # pylint: disable=g-import-not-at-top
  w1, b1, w2, b2 = w
  z1 = images @ w1 + b1
  h = np.maximum(z1, 0)
  z2 = (h @ w2 + b2)[:, 0]
  dz2 = (1 / (1 + np.exp(-z2)) - labels) / len(labels)
  dh = np.outer(dz2, w2[:, 0]) * (z1 > 0)
  return [images.T @ dh, dh.sum(0), h.T @ dz2[:, None], dz2.sum(keepdims=True)]


def reference(workload: Workload):
  """float64 NumPy: FedAvg's sum, SCAFFOLD's sum, c-sum and new c_i."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  f64 = lambda v: v.astype(np.float64)
  x, c = f64(workload.x), f64(workload.c)
  steps, n = workload.steps, workload.steps * workload.batch
  fedavg_sum, scaffold_sum, cv_sum = (np.zeros_like(x) for _ in range(3))
  new_states = []
  for i in range(workload.clients):
    ci = f64(workload.states[i])
    for correction, total in ((None, fedavg_sum), (c - ci, scaffold_sum)):
      w = x.copy()
      for k in range(steps):
        g = np.concatenate([t.ravel() for t in _gradient(
            split(w), f64(workload.images[i, k]), f64(workload.labels[i, k]))])
        w = w - LEARNING_RATE * (g if correction is None else g + correction)
      total += n * (w - x)
    new_ci = ci - c + (x - w) / (steps * LEARNING_RATE)
    cv_sum += new_ci - ci
    new_states.append(new_ci)
  return fedavg_sum, scaffold_sum, cv_sum, np.stack(new_states)


class MismatchError(Exception):
  """A floor's round differs from the float64 reference."""


def check(name: str, got, want) -> None:
  """MismatchError unless each tensor of each result (and of each client's
  new c_i) is within _TOLERANCE of its own largest reference value."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  labels = ('FedAvg sum', 'SCAFFOLD sum', 'SCAFFOLD c sum', 'new c_i')
  for label, g, r in zip(labels, got, want):
    if g.shape != r.shape:
      raise MismatchError(f'{name}: {label} has shape {g.shape}, not '
                          f'{r.shape}')
    for row, (g_row, r_row) in enumerate(zip(np.atleast_2d(g),
                                             np.atleast_2d(r))):
      for tensor, (g_t, r_t) in enumerate(zip(split(g_row), split(r_row))):
        error = np.max(np.abs(g_t - r_t)) / max(np.max(np.abs(r_t)), 1e-30)
        if not error <= _TOLERANCE:
          where = f' of client {row}' if label == 'new c_i' else ''
          raise MismatchError(
              f'{name}: {label}{where}, tensor {tensor} {SHAPES[tensor]}, is '
              f'off the float64 reference by {error:.1e} of its largest value')


class CFloor:
  """benchmarks/fused_floor.c, built once into a temporary directory."""

  def __init__(self, directory: str, batch: int):
    self._directory = directory
    self._binary = os.path.join(directory, 'fused_floor')
    command = ['cc', '-O3', '-march=native', '-fopenmp', f'-DBATCH={batch}',
               '-o', self._binary, _SOURCE, '-lm']
    try:
      subprocess.run(command, check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
      raise UsageError('the C floors need a C compiler (cc) with OpenMP; '
                       'none found (--floors=xla runs without one)') from e
    except subprocess.CalledProcessError as e:
      last = (e.stderr.strip().splitlines() or ['no output'])[-1]
      raise UsageError(f'cc could not build {_SOURCE} (it needs OpenMP): '
                       f'{last}') from e

  def run(self, workload: Workload, states: str, rounds: int, threads: int,
          check_only: bool):
    data = os.path.join(self._directory, f'data_{workload.clients}')
    shutil.rmtree(data, ignore_errors=True)
    os.makedirs(data)
    env = dict(os.environ)
    if threads:
      env['OMP_NUM_THREADS'] = str(threads)
    try:
      workload.write(data, states_in_files=states != 'memory')
      try:
        out = subprocess.run(
            [self._binary, data, str(workload.clients), str(workload.steps),
             str(workload.batch), repr(LEARNING_RATE), str(rounds), states,
             '1' if check_only else '0'],
            check=True, capture_output=True, text=True, env=env).stdout
      except subprocess.CalledProcessError as e:
        last = (e.stderr.strip().splitlines() or [f'status {e.returncode}'])
        raise EnvironmentFault(f'the C floor ({states}) failed: '
                               f'{last[-1]}') from e
      if check_only:
        import numpy as np  # pylint: disable=g-import-not-at-top
        read = lambda n: np.fromfile(os.path.join(data, n), np.float32)
        return (read('fedavg_sum.f32'), read('scaffold_sum.f32'),
                read('scaffold_cv_sum.f32'),
                read('states_after.f32').reshape(workload.states.shape))
      threads_used, fedavg, scaffold = out.split()
      return int(threads_used), float(fedavg), float(scaffold)
    finally:
      shutil.rmtree(data, ignore_errors=True)


class XlaFloor:
  """Each algorithm's client as one XLA-compiled TF function.

  `states='memory'` keeps each c_i as tensors in RAM; `states='file'` keeps
  each in a file of its own under `directory`, read at the client's start
  (`read_file`, `parse_tensor`) and written back over the same file at its
  end (`serialize_tensor`, `write_file`; XLA makes c_i+ as one flat
  tensor): the fewest TF ops that read and write a state file, with no
  versions, checksum or page-cache handling. The clients of a round are
  split over `threads` Python threads (0: one per core), each with sums of
  its own, added at the round's end.
  """

  def __init__(self, steps: int, states: str = 'memory',
               directory: str = '', threads: int = 0):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if states not in ('memory', 'file'):
      raise UsageError(f'unknown state mode {states!r}')
    self._tf = tf
    self._states = states
    self._directory = directory
    self._threads = threads or os.cpu_count() or 1
    ends = [0]
    for shape in SHAPES:
      ends.append(ends[-1] + math.prod(shape))

    def loss(w, images, labels):
      hidden = tf.nn.relu(images @ w[0] + w[1])
      logits = (hidden @ w[2] + w[3])[:, 0]
      return tf.reduce_mean(
          tf.nn.sigmoid_cross_entropy_with_logits(labels, logits))

    def train(x, correction, images, labels):
      w = list(x)
      for k in range(steps):
        g = tf.gradients(loss(w, images[k], labels[k]), w)
        if correction is not None:
          g = [gi + ci for gi, ci in zip(g, correction)]
        w = [wi - LEARNING_RATE * gi for wi, gi in zip(w, g)]
      return w

    @tf.function(jit_compile=True)
    def fedavg(x, total, n, images, labels):
      w = train(x, None, images, labels)
      return [t + n * (wi - xi) for t, wi, xi in zip(total, w, x)]

    def scaffold_math(x, c, ci, total, cv_total, n, images, labels):
      w = train(x, [a - b for a, b in zip(c, ci)], images, labels)
      new_ci = [b - a + (xi - wi) / (steps * LEARNING_RATE)
                for a, b, xi, wi in zip(c, ci, x, w)]
      return ([t + n * (wi - xi) for t, wi, xi in zip(total, w, x)],
              [t + (a - b) for t, a, b in zip(cv_total, new_ci, ci)], new_ci)

    scaffold = tf.function(scaffold_math, jit_compile=True)

    @tf.function(jit_compile=True)
    def scaffold_flat(x, c, ci, total, cv_total, n, images, labels):
      total, cv_total, new_ci = scaffold_math(x, c, ci, total, cv_total, n,
                                              images, labels)
      return total, cv_total, tf.concat(
          [tf.reshape(t, [-1]) for t in new_ci], 0)

    @tf.function
    def scaffold_file(path, x, c, total, cv_total, n, images, labels):
      flat = tf.ensure_shape(
          tf.io.parse_tensor(tf.io.read_file(path), tf.float32), [ends[-1]])
      ci = [tf.reshape(flat[a:b], s)
            for a, b, s in zip(ends[:-1], ends[1:], SHAPES)]
      total, cv_total, new_flat = scaffold_flat(x, c, ci, total, cv_total, n,
                                                images, labels)
      written = tf.io.write_file(path, tf.io.serialize_tensor(new_flat))
      with tf.control_dependencies([written]):
        return ([tf.identity(t) for t in total],
                [tf.identity(t) for t in cv_total])

    self._fedavg, self._scaffold = fedavg, scaffold
    self._scaffold_file = scaffold_file

  @property
  def threads(self) -> int:
    return self._threads

  def _path(self, client: int) -> str:
    return os.path.join(self._directory, f'state_{client}')

  def _clients(self, scaffold: bool, x, c, states, data, n, clients):
    tf = self._tf
    total = [tf.zeros(s) for s in SHAPES]
    cv_total = [tf.zeros(s) for s in SHAPES]
    for i in clients:
      images, labels = data[i]
      if not scaffold:
        total = self._fedavg(x, total, n, images, labels)
      elif self._states == 'file':
        total, cv_total = self._scaffold_file(
            tf.constant(self._path(i)), x, c, total, cv_total, n, images,
            labels)
      else:
        total, cv_total, states[i] = self._scaffold(
            x, c, states[i], total, cv_total, n, images, labels)
    return total, cv_total

  def _round(self, scaffold: bool, x, c, states, data, n):
    import concurrent.futures  # pylint: disable=g-import-not-at-top
    threads = min(self._threads, len(data))
    chunks = [range(len(data))[t::threads] for t in range(threads)]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      parts = list(pool.map(
          lambda chunk: self._clients(scaffold, x, c, states, data, n, chunk),
          chunks))
    add = lambda tensors: [self._tf.add_n(list(t)) for t in zip(*tensors)]
    return add([p[0] for p in parts]), add([p[1] for p in parts])

  def run(self, workload: Workload, rounds: int, check_only: bool):
    import numpy as np  # pylint: disable=g-import-not-at-top
    tf = self._tf
    x, c, data, n = _tf_inputs(workload)
    states = [[tf.constant(t) for t in split(s)] for s in workload.states]
    if self._states == 'file':
      for i, state in enumerate(workload.states):
        tf.io.write_file(self._path(i), tf.io.serialize_tensor(state))
      states = None
    if check_only:
      fedavg_sum, _ = self._round(False, x, c, states, data, n)
      scaffold_sum, cv_sum = self._round(True, x, c, states, data, n)
      if self._states == 'file':
        new_states = np.stack([
            tf.io.parse_tensor(tf.io.read_file(self._path(i)),
                               tf.float32).numpy()
            for i in range(workload.clients)])
      else:
        new_states = np.stack([_flat(s) for s in states])
      return _flat(fedavg_sum), _flat(scaffold_sum), _flat(cv_sum), new_states
    return _time_alternately(
        lambda scaffold: self._round(scaffold, x, c, states, data, n)[0],
        rounds)


class FactoredFloor:
  """Both algorithms in plain TF with W1's updates and c_i kept factored.

  Under Option II with plain SGD, c_i+ = c_i - c + (x - y) / (K eta) is the
  mean of the K gradients the client took, and W1's gradient at step k is
  A_k^T D_k (A_k: the step's B images, D_k: the loss's gradient at the first
  layer's pre-activations, B x 64). So W1's part of c_i is exactly
  A^T D / K with A, D the client's K*B rows: its state is (A, D) and the
  small tensors' c_i, 0.85 MB instead of 5.4 MB, and no client forms a
  21168 x 64 tensor: a step's first-layer products come from A_k [x1 | c1]
  (once per client) and the earlier steps' A_k A_j^T D_j; the round's sums of
  W1 are one matmul over every client's stacked factors at the round's end.
  FedAvg is made the same way (no correction), so the two compare like for
  like. Exact in real arithmetic, not in float32's order of operations.
  Each client one `tf.function`, on one thread; c_i in RAM.
  """

  def __init__(self, steps: int, batch: int):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    self._tf = tf
    self._steps, self._batch = steps, batch
    pixels, hidden = SHAPES[0]

    def client(xc1, x_small, c_small, a_prev, d_prev, ci_small, images,
               labels, scaffold):
      a = tf.reshape(images, [steps * batch, pixels])
      products = a @ xc1  # A [x1 | c1]: the one read of x1 and c1.
      ax, ac = products[:, :hidden], products[:, hidden:]
      gram = a @ tf.transpose(a)
      if scaffold:
        a_ci = (a @ tf.transpose(a_prev)) @ d_prev / steps  # A c_i1
        correction = [cs - cis for cs, cis in zip(c_small, ci_small)]
      b1, w2, b2 = x_small
      deltas, small_gradients = [], []
      for k in range(steps):
        rows = slice(k * batch, (k + 1) * batch)
        z1 = ax[rows]
        for j in range(k):
          z1 -= LEARNING_RATE * gram[rows, j * batch:(j + 1) * batch] @ (
              deltas[j])
        if scaffold and k:
          z1 -= k * LEARNING_RATE * (ac[rows] - a_ci[rows])
        z1 += b1
        hidden_out = tf.nn.relu(z1)
        logits = (hidden_out @ w2 + b2)[:, 0]
        loss = tf.reduce_mean(
            tf.nn.sigmoid_cross_entropy_with_logits(labels[k], logits))
        d1, gw2, gb2 = tf.gradients(loss, [z1, w2, b2])
        gradients = [tf.reduce_sum(d1, 0), gw2, gb2]
        deltas.append(d1)
        small_gradients.append(gradients)
        if scaffold:
          gradients = [g + cr for g, cr in zip(gradients, correction)]
        b1, w2, b2 = [w - LEARNING_RATE * g
                      for w, g in zip((b1, w2, b2), gradients)]
      mean_small = [tf.add_n(list(g)) / steps for g in zip(*small_gradients)]
      return tf.concat(deltas, 0), [b1, w2, b2], mean_small

    self._scaffold = tf.function(
        lambda *args: client(*args, scaffold=True))
    self._fedavg = tf.function(
        lambda xc1, xs, cs, images, labels: client(
            xc1, xs, cs, None, None, None, images, labels, scaffold=False))

  def factor_states(self, workload: Workload, seed: int):
    """Gives `workload` c_i that have factors (W1's part A^T D / K, as a
    client's previous round leaves it) and returns the factors."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    tf = self._tf
    rng = np.random.default_rng(seed)
    rows = self._steps * self._batch
    factors = []
    for i in range(workload.clients):
      a = rng.random((rows, SHAPES[0][0]), dtype=np.float32)
      d = rng.standard_normal((rows, SHAPES[0][1]), np.float32) * 1e-3
      small = [rng.standard_normal(s, np.float32) * 0.01 for s in SHAPES[1:]]
      w1 = (a.astype(np.float64).T @ d.astype(np.float64) / self._steps)
      workload.states[i] = np.concatenate(
          [w1.astype(np.float32).ravel()] + [t.ravel() for t in small])
      factors.append((tf.constant(a), tf.constant(d),
                      [tf.constant(t) for t in small]))
    return factors

  def _round(self, scaffold: bool, x, c, states, data, n):
    tf = self._tf
    pixels = SHAPES[0][0]
    clients = len(data)
    xc1 = tf.concat([x[0], c[0]], 1)
    x_small, c_small = x[1:], c[1:]
    outputs = []
    for i, (images, labels) in enumerate(data):
      if scaffold:
        a_prev, d_prev, ci_small = states[i]
        outputs.append(self._scaffold(xc1, x_small, c_small, a_prev, d_prev,
                                      ci_small, images, labels))
      else:
        outputs.append(self._fedavg(xc1, x_small, c_small, images, labels))
    images_all = tf.concat([tf.reshape(d[0], [-1, pixels]) for d in data], 0)
    gradient_sum = tf.matmul(images_all, tf.concat([o[0] for o in outputs], 0),
                             transpose_a=True)  # Sum of every client's steps.
    small_sums = [tf.add_n([o[1][j] for o in outputs]) for j in range(3)]
    total_small = [n * (s - clients * xs) for s, xs in zip(small_sums, x_small)]
    if not scaffold:
      return [-n * LEARNING_RATE * gradient_sum] + total_small, None
    steps = self._steps
    old_w1_sum = tf.matmul(tf.concat([s[0] for s in states], 0),
                           tf.concat([s[1] for s in states], 0),
                           transpose_a=True) / steps
    total_w1 = (-n * LEARNING_RATE * gradient_sum -
                n * steps * LEARNING_RATE * (clients * c[0] - old_w1_sum))
    cv_total = [gradient_sum / steps - old_w1_sum] + [
        tf.add_n([o[2][j] - s[2][j] for o, s in zip(outputs, states)])
        for j in range(3)]
    for i, (images, _) in enumerate(data):  # c_i+: this round's factors.
      states[i] = (tf.reshape(images, [-1, pixels]), outputs[i][0],
                   outputs[i][2])
    return [total_w1] + total_small, cv_total

  def _dense(self, state):
    import numpy as np  # pylint: disable=g-import-not-at-top
    a, d, small = state
    w1 = a.numpy().astype(np.float64).T @ d.numpy() / self._steps
    return np.concatenate([w1.astype(np.float32).ravel()] +
                          [t.numpy().ravel() for t in small])

  def run(self, workload: Workload, factors, rounds: int, check_only: bool):
    """As `XlaFloor.run`; `factors` from `factor_states(workload)`."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    x, c, data, n = _tf_inputs(workload)
    states = list(factors)
    if check_only:
      fedavg_sum, _ = self._round(False, x, c, None, data, n)
      scaffold_sum, cv_sum = self._round(True, x, c, states, data, n)
      return (_flat(fedavg_sum), _flat(scaffold_sum), _flat(cv_sum),
              np.stack([self._dense(s) for s in states]))
    return _time_alternately(
        lambda scaffold: self._round(scaffold, x, c, states, data, n)[0],
        rounds)


def _tf_inputs(workload: Workload):
  """x and c as the model's tensors, each client's (images, labels), and
  n, the examples a client processes."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x, c = ([tf.constant(t) for t in split(v)] for v in (workload.x, workload.c))
  data = [(tf.constant(workload.images[i]), tf.constant(workload.labels[i]))
          for i in range(workload.clients)]
  return x, c, data, tf.constant(float(workload.steps * workload.batch))


def _flat(tensors):
  """Tensors as one flat NumPy vector."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  return np.concatenate([t.numpy().ravel() for t in tensors])


def _time_alternately(round_fn, rounds: int) -> tuple[float, float]:
  """Median seconds of FedAvg's and SCAFFOLD's rounds (`round_fn(False)`,
  `round_fn(True)`: a round's sums), alternating, after one untimed pair."""
  seconds = {False: [], True: []}
  for r in range(rounds + 1):
    for scaffold in (False, True):
      started = time.perf_counter()
      round_fn(scaffold)[0].numpy()  # Waits for the round.
      if r:
        seconds[scaffold].append(time.perf_counter() - started)
  median = lambda v: sorted(v)[len(v) // 2]
  return median(seconds[False]), median(seconds[True])


if __name__ == '__main__':
  from pipeline import errors as _errors  # pylint: disable=g-import-not-at-top
  _errors.refuse_to_run_library_module(__spec__)

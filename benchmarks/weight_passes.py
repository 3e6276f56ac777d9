"""What one pass over the benchmark model's weights costs this machine: the
unit in which SCAFFOLD's and FedRes's extra work over FedAvg is counted.

A client round of `benchmarks.rounds` (K=2 steps of 5 images on a 5.4 MB
model) is bound by memory traffic, not arithmetic: each elementwise op over
the weights reads and writes megabytes and does one flop per float. This
times, with the whole machine busy (independent ops, TF's default thread
pools), the ops a stateful client adds to FedAvg's: an elementwise
difference (c_i - c, the new c_i, its delta and the delta's sum), a scaling,
a fused in-place SGD step (each corrected step's second update), and the
state store's concatenation, serialization and parsing. It prints each op's
machine time per client-sized op and the memory traffic that implies. Last,
SCAFFOLD's finish (the new c_i and its delta: a scaling and two differences)
as TF ops and as one XLA-compiled function (`jit_compile=True`), which fuses
them into one loop per variable: whether fewer kernels would save time.
Then the first Dense layer's forward product (a batch's inputs times its
21168 x 64 kernel) by the number of rows it takes at once: a client step
takes one of 5 rows, and its time per row is what products of many clients'
rows at once (the kernel being the same for all of a group's clients) would
save.

  .venv/bin/python -m benchmarks.weight_passes [--repeats=200]
"""

import collections
import math
import re
import time

from absl import flags

from binaries import app  # First: imports TensorFlow quietly.
from benchmarks import state_files
from pipeline import tf_logs
from pipeline.errors import UsageError

_REPEATS = flags.DEFINE_integer('repeats', 200, 'Ops timed per case.')
_TRIALS = flags.DEFINE_integer('trials', 5, 'Timed trials per case (median).')


_XLA_CPU_NOISE = re.compile('SetPriority unimplemented for this stream')

# Distinct buffers, cycled: together larger than the last-level cache, as a
# client's weights, gradients, control variates and deltas are.
_POOL = 16


def _cases(tf, shapes):
  """name -> (op(i), the i-th client-sized op of the pool; its bytes read +
  written or None), and the model's size in bytes."""
  size = sum(math.prod(shape) for shape in shapes) * 4
  rng = tf.random.Generator.from_seed(0)

  def model_sized():
    return [rng.normal(shape) for shape in shapes]

  a = [model_sized() for _ in range(_POOL)]
  b = [model_sized() for _ in range(_POOL)]
  flat = [tf.concat([tf.reshape(t, [-1]) for t in x], 0) for x in a]
  blob = [tf.io.serialize_tensor(x) for x in flat]
  variables = [[tf.Variable(t) for t in x] for x in a]
  zeros = [tf.zeros(shape) for shape in shapes]  # Keeps the weights as they are.
  c = [model_sized() for _ in range(_POOL)]
  steps_times_lr = tf.constant(0.006)

  def new_control_variate(client_minus_server, delta, client_cv, scale):
    # SCAFFOLD Option II's finish: c_i+ = (c_i - c) - d / (K eta) and its
    # delta c_i+ - c_i, as scaffold/math.py writes it.
    new = [cmc - d / scale for cmc, d in zip(client_minus_server, delta)]
    return new, [n - o for n, o in zip(new, client_cv)]

  finish_ops = tf.function(new_control_variate)
  # XLA fuses the three elementwise passes into one loop per variable.
  finish_fused = tf.function(new_control_variate, jit_compile=True)
  # XLA's first compile on a CPU logs an error line that is not one.
  with tf_logs.stderr_without(_XLA_CPU_NOISE):
    finish_fused(a[0], b[0], c[0], steps_times_lr)
  cases = {
      'difference a - b': (
          lambda i: [x - y for x, y in zip(a[i], b[i])], 3 * size),
      'scaling a / s': (lambda i: [x / 3.0 for x in a[i]], 2 * size),
      'in-place SGD step': (
          lambda i: [tf.raw_ops.ResourceApplyGradientDescent(
              var=v.handle, alpha=tf.constant(0.1), delta=z)
                     for v, z in zip(variables[i], zeros)], 3 * size),
      'concat (state write)': (
          lambda i: [tf.concat([tf.reshape(t, [-1]) for t in a[i]], 0)],
          2 * size),
      # Copies through a TensorProto: traffic not counted.
      'serialize_tensor (state write)': (
          lambda i: [tf.io.serialize_tensor(flat[i])], None),
      'parse_tensor (state read)': (
          lambda i: [tf.io.parse_tensor(blob[i], tf.float32)], None),
      'new c_i + delta (TF ops)': (
          lambda i: tf.nest.flatten(
              finish_ops(a[i], b[i], c[i], steps_times_lr)), None),
      'new c_i + delta (XLA-fused)': (
          lambda i: tf.nest.flatten(
              finish_fused(a[i], b[i], c[i], steps_times_lr)), None),
  }
  return cases, size


# Rows of one forward product of the first layer: one client step's batch
# (5), a client's steps, a group's clients' steps.
PRODUCT_ROWS = (5, 10, 20, 50, 100, 500)


def _product_cases(tf, kernel_shape):
  """rows -> op(i): the i-th product of `rows` input rows with the
  kernel (one variable, as a group's clients read the same one)."""
  rng = tf.random.Generator.from_seed(1)
  kernel = tf.Variable(rng.normal(kernel_shape))
  cases = {}
  for rows in PRODUCT_ROWS:
    inputs = [rng.normal([rows, kernel_shape[0]]) for _ in range(_POOL)]
    cases[rows] = (lambda i, x=inputs: [tf.matmul(x[i], kernel)])
  return cases


def _time(op, repeats: int) -> float:
  # Eagerly, one op at a time, each split over the cores by TF's intra-op
  # pool: a traced function would merge the repeats on the same inputs into
  # one (common subexpression elimination). At 5.4 MB an op, the eager call's
  # own cost (~10 us) does not count.
  # The last few results stay alive, as a round holds several model-sized
  # tensors: freeing each at once lets malloc return the memory and fault
  # fresh pages in for the next (serialize_tensor: 10x slower).
  alive = collections.deque(op(0), maxlen=4)  # Also warms up.
  seconds = []
  for _ in range(_TRIALS.value):
    started = time.perf_counter()
    for i in range(repeats):
      alive.extend(op(i % _POOL))
    seconds.append(time.perf_counter() - started)
  return sorted(seconds)[len(seconds) // 2]


def main(argv):
  del argv
  for flag in (_REPEATS, _TRIALS):
    if flag.value < 1:
      raise UsageError(f'--{flag.name} must be >= 1, got {flag.value}')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cases, size = _cases(tf, state_files.GLOBAL_SHAPES)
  print(f'one op over the benchmark model ({size / 1e6:.1f} MB), '
        f'{_REPEATS.value} ops a trial, median of {_TRIALS.value} trials:')
  for name, (op, traffic) in cases.items():
    seconds = _time(op, _REPEATS.value) / _REPEATS.value
    print(f'  {name:32s} {1000 * seconds:6.3f} ms' + (
        f'  ({traffic / seconds / 1e9:5.1f} GB/s read + written)'
        if traffic else ''))
  kernel_shape = state_files.GLOBAL_SHAPES[0]
  print(f'the first layer\'s forward product (rows x {kernel_shape[0]} '
        f'inputs, times its {kernel_shape[0]} x {kernel_shape[1]} kernel):')
  for rows, op in _product_cases(tf, kernel_shape).items():
    seconds = _time(op, _REPEATS.value) / _REPEATS.value
    print(f'  {rows:4d} rows {1000 * seconds:7.3f} ms  '
          f'({5000 * seconds / rows:6.3f} ms per 5 rows)')


if __name__ == '__main__':
  app.run(main)

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
machine time per client-sized op and the memory traffic that implies.

  .venv/bin/python -m benchmarks.weight_passes [--repeats=200]
"""

import math
import time

from absl import flags

from binaries import app  # First: imports TensorFlow quietly.
from benchmarks import state_files
from pipeline.errors import UsageError

_REPEATS = flags.DEFINE_integer('repeats', 200, 'Ops timed per case.')
_TRIALS = flags.DEFINE_integer('trials', 5, 'Timed trials per case (median).')


def _cases(tf, shapes):
  """name -> (one client-sized op, its bytes read + written or None)."""
  size = sum(math.prod(shape) for shape in shapes) * 4
  rng = tf.random.Generator.from_seed(0)
  a = [rng.normal(shape) for shape in shapes]
  b = [rng.normal(shape) for shape in shapes]
  flat = tf.concat([tf.reshape(t, [-1]) for t in a], 0)
  blob = tf.io.serialize_tensor(flat)
  variables = [tf.Variable(t) for t in a]
  zeros = [tf.zeros(shape) for shape in shapes]
  return {
      'difference a - b': (lambda: [x - y for x, y in zip(a, b)], 3 * size),
      'scaling a / s': (lambda: [x / 3.0 for x in a], 2 * size),
      # Adds zero: the weights stay finite whatever the repeats.
      'in-place SGD step': (lambda: [
          tf.raw_ops.ResourceApplyGradientDescent(
              var=v.handle, alpha=tf.constant(0.1), delta=z)
          for v, z in zip(variables, zeros)], 3 * size),
      'concat (state write)': (lambda: [tf.concat(
          [tf.reshape(t, [-1]) for t in a], 0)], 2 * size),
      # Copies through a TensorProto: traffic not counted.
      'serialize_tensor (state write)': (
          lambda: [tf.io.serialize_tensor(flat)], None),
      'parse_tensor (state read)': (
          lambda: [tf.io.parse_tensor(blob, tf.float32)], None),
  }, size


def _time(tf, op, repeats: int) -> float:
  @tf.function
  def run():
    done = []
    for _ in range(repeats):  # Independent ops: every core takes some.
      done.extend(op())
    with tf.control_dependencies(done):
      return tf.constant(0)

  run()  # Trace and warm up.
  seconds = []
  for _ in range(_TRIALS.value):
    started = time.perf_counter()
    run()
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
        f'{_REPEATS.value} independent ops a trial, median of '
        f'{_TRIALS.value} trials, the whole machine:')
  for name, (op, traffic) in cases.items():
    seconds = _time(tf, op, _REPEATS.value) / _REPEATS.value
    print(f'  {name:32s} {1000 * seconds:6.3f} ms' + (
        f'  ({traffic / seconds / 1e9:5.1f} GB/s read + written)'
        if traffic else ''))


if __name__ == '__main__':
  app.run(main)

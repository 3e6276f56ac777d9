"""Do several TFF workers run their sub-rounds at the same time?

With `--num_workers` or `--worker_addresses`, TFF's mergeable context gives
each worker a sub-round. This times one call of a computation whose clients
each spin a single-threaded TF loop (so two clients fit on two cores without
competing), with one client per worker on N local workers, through:

- `tff`: TFF's own async contexts, one per worker (what the project used
  before): their gRPC calls block the context's one event loop, so a worker
  waits for the one before it to finish;
- `threaded`: the project's contexts (`pipeline/tff_runtime.py`), each call in
  a thread of its own.

It prints each form's median seconds a call against one client alone. Run
with N at most the number of cores, or the workers compete for them.

  .venv/bin/python -m benchmarks.worker_overlap [--workers=2] [--calls=5]
"""

import statistics
import time

from absl import flags

from binaries import app  # First: imports TensorFlow quietly.
from pipeline.errors import UsageError

_WORKERS = flags.DEFINE_integer('workers', 2, 'Local TFF workers.')
_CALLS = flags.DEFINE_integer('calls', 5, 'Timed calls per form (median).')
_STEPS = flags.DEFINE_integer('steps', 200000,
                              'Loop steps a client spins (about 0.6 s here).')


def _computations(steps: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top

  @tff.tensorflow.computation(np.float32)
  def spin(x):
    # Scalar ops one after another: one core, whatever TF's thread pools.
    _, y = tf.while_loop(lambda i, y: i < steps,
                         lambda i, y: (i + 1, y * 0.999 + 0.001), (0, x))
    return y

  @tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
  def total(values):
    return tff.federated_sum(tff.federated_map(spin, values))

  return spin, total


def _median_seconds(fn, calls: int) -> float:
  fn()  # Compiles, starts the workers.
  seconds = []
  for _ in range(calls):
    started = time.perf_counter()
    fn()
    seconds.append(time.perf_counter() - started)
  return statistics.median(seconds)


def main(argv):
  del argv
  for flag in (_WORKERS, _CALLS, _STEPS):
    if flag.value < 1:
      raise UsageError(f'--{flag.name} must be >= 1, got {flag.value}')
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from pipeline import tff_runtime  # pylint: disable=g-import-not-at-top
  from tff_algos import tff_internals  # pylint: disable=g-import-not-at-top
  # pylint: disable=protected-access
  tff_runtime.configure_execution(num_workers=_WORKERS.value)
  spin, total = _computations(_STEPS.value)
  values = [0.5] * _WORKERS.value
  try:
    workers = [tff_runtime._local_worker() for _ in range(_WORKERS.value)]
    with tff.framework.get_context_stack().install(
        tff_runtime._native_context(workers[0], asynchronous=False)):
      alone = _median_seconds(lambda: spin(0.5), _CALLS.value)
    print(f'one client alone: {alone:.3f} s')
    forms = {
        'tff': [tff_runtime._native_context(w, asynchronous=True)
                for w in workers],
        'threaded': [tff_internals.threaded_async_context(
            tff_runtime._native_context(w, asynchronous=False))
                     for w in workers],
    }
    for name, contexts in forms.items():
      context = tff.backends.native.create_mergeable_comp_execution_context(
          contexts, num_subrounds=_WORKERS.value)
      with tff.framework.get_context_stack().install(context):
        seconds = _median_seconds(lambda: total(values), _CALLS.value)
      print(f'{name:8s} {_WORKERS.value} workers, a client each: '
            f'{seconds:.3f} s a call, x{seconds / alone:.2f} one client alone')
  finally:
    tff_runtime.shutdown_workers()


if __name__ == '__main__':
  app.run(main)

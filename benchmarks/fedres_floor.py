r"""What FedResAvg's arithmetic costs over FedAvg's, in the fastest form we know.

`benchmarks.rounds` measures this project's rounds: FedResAvg's is 1.5-1.8x
FedAvg's on the benchmark's task (README, Benchmark). This measures how much
of that the algorithm itself needs, with no framework, no data pipeline and
no state files: each algorithm's whole round is one XLA-compiled JAX
computation that loops over the round's clients in sequence (`lax.scan`),
every input in RAM. That is the fastest form of a FedAvg round measured on
this machine.

The workload is `benchmarks.rounds`': K=--client_steps steps of
--client_batch_size examples a client, the CelebA-shaped global model
(flatten + Dense(64, relu) + Dense(1), 5.4 MB) and FedRes's personal model of
12.5% of its size (flatten + Dense(8, relu) + Dense(1)); random images and
labels. The rounds ([FedRes] Alg. 4; each client's data is one pass of K
batches, and FedResAvg's Step 2 takes them in reverse order, as a fresh pass
would take other batches):

- `fedavg`: K SGD steps on w; the example-weighted mean of w_i - w.
- `fedres_avg_1`: Option I. Step 1, K steps on theta_i with w fixed (each a
  forward pass of both models); Step 2, K steps on a copy of w with theta_i
  fixed; w + mean(w_i - w); each client's new theta_i kept.
- `fedres_avg_1_stacked`: the same, with Step 1's K forward passes of the
  global model (all at w) as one product over the K batches: the one
  rewrite of Option I's arithmetic we know that does less work.
- `fedres_avg_2`: Option II with each c_i dense in RAM: Step 2's steps
  corrected by c - c_i, c_i+ the mean of its K gradients, sums of
  c_i+ - c_i. Option II does all of Option I's work and more.

Each algorithm's round is first checked on 3 clients against a float64 NumPy
reference of the same math (what the round changes, each tensor within 1e-3
of the reference's largest change), so the rounds time the algorithms, not something cheaper. Then the
algorithms' rounds alternate, every other repeat in reverse order, and each
line gives a round's seconds (median of --rounds timed rounds after one
untimed, per repeat) and its ratio to FedAvg's (median over the repeats of
each repeat's own ratio).

  .venv/bin/python -m benchmarks.fedres_floor [--clients_per_round=100]
      [--rounds=5] [--repeats=3]
"""

import os
import statistics
import time

# JAX's CPU backend, without looking for others.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import logging  # pylint: disable=g-import-not-at-top,g-bad-import-order

from absl import flags  # pylint: disable=g-import-not-at-top

from binaries import app  # pylint: disable=g-bad-import-order
from pipeline.errors import UsageError


def _define_flags() -> None:
  """The program's flags; defined when it runs, so that the module imports
  beside others that define flags of these names (the tests')."""
  flags.DEFINE_integer('clients_per_round', 100, 'Clients a round.')
  flags.DEFINE_integer('client_steps', 2, 'K, local steps a client.')
  flags.DEFINE_integer('client_batch_size', 5, 'Examples a step.')
  flags.DEFINE_integer('rounds', 5, 'Timed rounds a repeat.')
  flags.DEFINE_integer('repeats', 3, 'Alternated repeats.')


PIXELS, HIDDEN, LOCAL_HIDDEN = 84 * 84 * 3, 64, 8
# benchmarks.rounds' learning rates (eta, lambda); FedRes's population N
# for c's update, as there.
LEARNING_RATE, LOCAL_LEARNING_RATE = 0.01, 0.01
POPULATION = 2000
ALGORITHMS = ('fedavg', 'fedres_avg_1', 'fedres_avg_1_stacked',
              'fedres_avg_2')
_TOLERANCE = 1e-3


class Workload:
  """A round's inputs: w, c, and each client's batches, theta_i and c_i."""

  def __init__(self, clients: int, steps: int, batch: int, seed: int = 0):
    import numpy as np  # pylint: disable=g-import-not-at-top
    rng = np.random.default_rng(seed)

    def glorot(shape):
      return (rng.standard_normal(shape, np.float32) *
              np.float32(np.sqrt(2 / sum(shape))))

    def stacked(tensors):
      return [np.stack([t] * clients) for t in tensors]

    self.clients, self.steps, self.batch = clients, steps, batch
    self.w = [glorot((PIXELS, HIDDEN)), np.zeros(HIDDEN, np.float32),
              glorot((HIDDEN, 1)), np.zeros(1, np.float32)]
    self.c = [rng.standard_normal(v.shape, np.float32) * 0.01 for v in self.w]
    # theta_i as after some rounds (the output layer nonzero, unlike at its
    # zero start), so that Step 1 moves both of its layers.
    self.thetas = stacked([glorot((PIXELS, LOCAL_HIDDEN)),
                           np.zeros(LOCAL_HIDDEN, np.float32),
                           glorot((LOCAL_HIDDEN, 1)),
                           np.zeros(1, np.float32)])
    self.controls = [rng.standard_normal((clients,) + v.shape, np.float32) *
                     0.01 for v in self.w]
    self.images = rng.random((clients, steps, batch, PIXELS),
                             dtype=np.float32)
    self.labels = rng.integers(0, 2, (clients, steps, batch)).astype(
        np.float32)


def _numpy_gradients(w, theta, images, labels):
  """Gradients of the mean logistic loss of f_w(x) (+ f_theta(x)) for w and
  theta (None without theta), in the inputs' precision."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  def forward(p):
    z1 = images @ p[0] + p[1]
    h = np.maximum(z1, 0)
    return z1, h, (h @ p[2] + p[3])[:, 0]

  parts = [forward(w)] + ([forward(theta)] if theta is not None else [])
  z2 = sum(part[2] for part in parts)
  dz2 = (1 / (1 + np.exp(-z2)) - labels) / len(labels)

  def backward(p, part):
    z1, h, _ = part
    dh = np.outer(dz2, p[2][:, 0]) * (z1 > 0)
    return [images.T @ dh, dh.sum(0), h.T @ dz2[:, None], dz2.sum(0,
                                                                keepdims=True)]

  gradients = [backward(p, part) for p, part in zip(
      [w] + ([theta] if theta is not None else []), parts)]
  return gradients[0], (gradients[1] if theta is not None else None)


def reference(algorithm: str, workload: Workload):
  """The round's new w (and, for FedResAvg, each client's theta_i, and c and
  each c_i for Option II) in float64 NumPy."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  f64 = lambda tensors: [np.asarray(t, np.float64) for t in tensors]
  w = f64(workload.w)
  c = f64(workload.c)
  eta, lam = LEARNING_RATE, LOCAL_LEARNING_RATE
  delta_sum = [np.zeros_like(v) for v in w]
  control_sum = [np.zeros_like(v) for v in w]
  thetas, controls = [], []
  for i in range(workload.clients):
    images = workload.images[i].astype(np.float64)
    labels = workload.labels[i].astype(np.float64)
    if algorithm == 'fedavg':
      p = [v.copy() for v in w]
      for k in range(workload.steps):
        g, _ = _numpy_gradients(p, None, images[k], labels[k])
        p = [a - eta * b for a, b in zip(p, g)]
      # Every client has K * B examples: the weighted mean is the mean.
      delta_sum = [s + (a - b) for s, a, b in zip(delta_sum, p, w)]
      continue
    theta = f64([t[i] for t in workload.thetas])
    for k in range(workload.steps):  # Step 1: theta_i's steps, w fixed.
      _, g = _numpy_gradients(w, theta, images[k], labels[k])
      theta = [a - lam * b for a, b in zip(theta, g)]
    thetas.append(theta)
    control = f64([c_i[i] for c_i in workload.controls])
    p, gradient_sum = [v.copy() for v in w], [np.zeros_like(v) for v in w]
    for k in reversed(range(workload.steps)):  # Step 2: w's steps.
      g, _ = _numpy_gradients(p, theta, images[k], labels[k])
      if algorithm == 'fedres_avg_2':
        p = [a - eta * (b - ci + cc) for a, b, ci, cc in zip(p, g, control,
                                                              c)]
        gradient_sum = [s + b for s, b in zip(gradient_sum, g)]
      else:
        p = [a - eta * b for a, b in zip(p, g)]
    delta_sum = [s + (a - b) for s, a, b in zip(delta_sum, p, w)]
    if algorithm == 'fedres_avg_2':
      new_control = [s / workload.steps for s in gradient_sum]
      controls.append(new_control)
      control_sum = [s + (a - b) for s, a, b in zip(control_sum, new_control,
                                                    control)]
  w = [a + s / workload.clients for a, s in zip(w, delta_sum)]
  if algorithm == 'fedavg':
    return [w]
  if algorithm == 'fedres_avg_2':
    c = [a + s / POPULATION for a, s in zip(c, control_sum)]
    return [w, _stack(thetas), c, _stack(controls)]
  return [w, _stack(thetas)]


def _stack(per_client):
  import numpy as np  # pylint: disable=g-import-not-at-top
  return [np.stack(tensors) for tensors in zip(*per_client)]


def compiled_round(algorithm: str, clients: int, steps: int, batch: int):
  """The round as one jitted JAX function of (w, c, thetas, controls,
  images, labels), returning what `reference` returns."""
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  from jax import lax
  tree_map = jax.tree_util.tree_map
  eta, lam = LEARNING_RATE, LOCAL_LEARNING_RATE

  def mlp(p, x):
    return (jnp.maximum(x @ p[0] + p[1], 0) @ p[2] + p[3])[:, 0]

  def logistic_loss(logits, labels):
    return jnp.mean(jnp.maximum(logits, 0) - logits * labels +
                    jnp.log1p(jnp.exp(-jnp.abs(logits))))

  def fedavg(w, c, thetas, controls, images, labels):
    del c, thetas, controls

    def client(delta_sum, data):
      def step(p, batch_data):
        x, y = batch_data
        g = jax.grad(lambda q: logistic_loss(mlp(q, x), y))(p)
        return tree_map(lambda a, b: a - eta * b, p, g), None
      p, _ = lax.scan(step, w, data)
      return tree_map(lambda s, a, b: s + (a - b), delta_sum, p, w), None

    delta_sum, _ = lax.scan(client, tree_map(jnp.zeros_like, w),
                            (images, labels))
    return [tree_map(lambda a, s: a + s / clients, w, delta_sum)]

  def fedres(w, c, thetas, controls, images, labels):
    option2 = algorithm == 'fedres_avg_2'

    def client(sums, data):
      x, y, theta, control = data
      if algorithm == 'fedres_avg_1_stacked':
        # Step 1's K forward passes of the global model, all at w, as one.
        global_logits = mlp(w, x.reshape(steps * batch, PIXELS)).reshape(
            steps, batch)
      else:
        global_logits = jnp.zeros((steps, batch))

      def local_step(t, batch_data):
        xb, yb, zb = batch_data
        if algorithm == 'fedres_avg_1_stacked':
          loss = lambda q: logistic_loss(zb + mlp(q, xb), yb)
        else:
          loss = lambda q: logistic_loss(mlp(w, xb) + mlp(q, xb), yb)
        g = jax.grad(loss)(t)
        return tree_map(lambda a, b: a - lam * b, t, g), None

      theta, _ = lax.scan(local_step, theta, (x, y, global_logits))

      def global_step(carry, batch_data):
        p, gradient_sum = carry
        xb, yb = batch_data
        g = jax.grad(lambda q: logistic_loss(mlp(q, xb) + mlp(theta, xb),
                                             yb))(p)
        if option2:
          p = tree_map(lambda a, b, ci, cc: a - eta * (b - ci + cc), p, g,
                       control, c)
          gradient_sum = tree_map(lambda s, b: s + b, gradient_sum, g)
        else:
          p = tree_map(lambda a, b: a - eta * b, p, g)
        return (p, gradient_sum), None

      zeros = tree_map(jnp.zeros_like, w) if option2 else ()
      (p, gradient_sum), _ = lax.scan(global_step, (w, zeros),
                                      (x[::-1], y[::-1]))
      delta_sum, control_sum = sums
      delta_sum = tree_map(lambda s, a, b: s + (a - b), delta_sum, p, w)
      if option2:
        new_control = tree_map(lambda s: s / steps, gradient_sum)
        control_sum = tree_map(lambda s, a, b: s + (a - b), control_sum,
                               new_control, control)
      else:
        new_control = control
      return (delta_sum, control_sum), (theta, new_control)

    zeros = tree_map(jnp.zeros_like, w)
    (delta_sum, control_sum), (thetas, controls) = lax.scan(
        client, (zeros, zeros if option2 else ()),
        (images, labels, thetas, controls))
    w = tree_map(lambda a, s: a + s / clients, w, delta_sum)
    if option2:
      c = tree_map(lambda a, s: a + s / POPULATION, c, control_sum)
      return [w, thetas, c, controls]
    return [w, thetas]

  return jax.jit(fedavg if algorithm == 'fedavg' else fedres)


def _inputs(algorithm: str, workload: Workload):
  import numpy as np  # pylint: disable=g-import-not-at-top
  controls = (workload.controls if algorithm == 'fedres_avg_2' else
              # Unused: one float a client.
              [np.zeros((workload.clients, 1), np.float32)])
  return (workload.w, workload.c, workload.thetas, controls, workload.images,
          workload.labels)


class MismatchError(Exception):
  pass


def check(algorithm: str, steps: int, batch: int) -> None:
  """The compiled round on 3 clients against the float64 reference: what it
  changed (w, theta_i and c less their inputs; the new c_i), each tensor
  within 1e-3 of the reference's largest change."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  workload = Workload(3, steps, batch, seed=1)
  got = compiled_round(algorithm, 3, steps, batch)(*_inputs(algorithm,
                                                             workload))
  want = reference(algorithm, workload)
  zeros = [np.zeros(1)] * len(workload.w)
  inputs = (workload.w, workload.thetas, workload.c, zeros)
  names = ('w', 'theta_i', 'c', 'c_i')[:len(want)]
  for name, got_part, want_part, before_part in zip(names, got, want, inputs):
    for j, (a, b, before) in enumerate(zip(got_part, want_part, before_part,
                                           strict=True)):
      a = np.asarray(a, np.float64) - before
      b = b - before
      scale = max(float(np.max(np.abs(b))), 1e-12)
      if a.shape != b.shape or np.max(np.abs(a - b)) > _TOLERANCE * scale:
        raise MismatchError(f'{algorithm}: {name}[{j}] differs from the '
                            'float64 reference')


def _timed(round_fn, inputs, rounds: int) -> float:
  import jax  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(round_fn(*inputs))  # Compiles.
  seconds = []
  for _ in range(rounds):
    started = time.perf_counter()
    jax.block_until_ready(round_fn(*inputs))
    seconds.append(time.perf_counter() - started)
  return statistics.median(seconds)


def main(argv):
  del argv
  # jax 0.4.13 warns that it found no GPU or TPU even when told to use the
  # CPU alone.
  logging.getLogger('jax._src.xla_bridge').setLevel(logging.ERROR)
  values = flags.FLAGS
  for name in ('clients_per_round', 'client_steps', 'client_batch_size',
               'rounds', 'repeats'):
    if values[name].value < 1:
      raise UsageError(f'--{name} must be >= 1, got {values[name].value}')
  clients, steps, batch = (values.clients_per_round, values.client_steps,
                           values.client_batch_size)
  for algorithm in ALGORITHMS:
    check(algorithm, steps, batch)
  print('each round checked against a float64 reference on 3 clients',
        flush=True)
  import jax  # pylint: disable=g-import-not-at-top
  workload = Workload(clients, steps, batch)
  runs = {}
  for algorithm in ALGORITHMS:
    inputs = jax.device_put(_inputs(algorithm, workload))
    runs[algorithm] = (compiled_round(algorithm, clients, steps, batch),
                       inputs)
  seconds = {algorithm: [] for algorithm in ALGORITHMS}
  for repeat in range(values.repeats):
    order = ALGORITHMS if repeat % 2 == 0 else ALGORITHMS[::-1]
    for algorithm in order:
      seconds[algorithm].append(_timed(*runs[algorithm], values.rounds))
  for algorithm in ALGORITHMS:
    ratios = [a / b for a, b in zip(seconds[algorithm], seconds['fedavg'])]
    print(f'{algorithm:21s} {statistics.median(seconds[algorithm]):.3f} '
          f's/round ({", ".join(f"{s:.3f}" for s in seconds[algorithm])}), '
          f'x{statistics.median(ratios):.2f} fedavg\'s '
          f'({", ".join(f"x{r:.2f}" for r in ratios)})', flush=True)


if __name__ == '__main__':
  _define_flags()
  app.run(main)

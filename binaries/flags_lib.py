"""Command-line flags shared by the binaries (names fixed by SPEC 7)."""

from absl import flags

from pipeline import client_store
from tasks import base as task_base
from tff_algos import config as algo_config

# Experiment.
flags.DEFINE_string('task', None, 'Task name, e.g. celeba_smile.')
flags.DEFINE_string('algorithm', None, 'Algorithm name, e.g. fedavg.')
flags.DEFINE_string('experiment_name', None, 'Name of the run directory.')
flags.DEFINE_string('root_output_dir', 'runs', 'Root of all run directories.')
flags.DEFINE_integer('total_rounds', 10, 'Rounds to train (resumes if more).')
flags.DEFINE_integer('clients_per_round', 10, 'Clients sampled per round.')
flags.DEFINE_integer('rounds_per_eval', 1, 'Evaluate every this many rounds.')
flags.DEFINE_integer('rounds_per_checkpoint', 1,
                     'Checkpoint every this many rounds.')
flags.DEFINE_integer('seed', 0, 'Seed of initialization, sampling and data.')
flags.DEFINE_enum('client_state_store', 'memory', list(client_store.BACKENDS),
                  'Where per-client state lives.')
flags.DEFINE_enum('runtime', 'tff', ['tff'], 'Execution runtime.')
flags.DEFINE_integer('max_concurrent_computation_calls', -1,
                     'Cap on concurrent calls in the TFF C++ runtime '
                     '(<= 0: no cap).')

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
                    'Directory of MovieLens files (ML-100K u.data/u.item).')
flags.DEFINE_float('heterogeneity', 1.0,
                   'fedres_logistic: alpha of papers/000 eq. 13 in [0, 1]; 0 '
                   'gives every client the same distribution.')
flags.DEFINE_string('celeba_mode', 'mixed',
                    'celeba_smile: mixed (federated smiling / central '
                    'non-smiling) or federated (both labels on clients).')

# Optimization (common).
flags.DEFINE_string('client_optimizer', 'sgd', 'Client optimizer.')
flags.DEFINE_float('client_learning_rate', 0.01, 'Client learning rate eta.')
flags.DEFINE_string('server_optimizer', 'sgd', 'Server optimizer.')
flags.DEFINE_float('server_learning_rate', 1.0, 'Server learning rate eta_s.')

# Algorithm-specific (an error when set for an algorithm they do not apply to).
flags.DEFINE_integer('central_batch_size', 500, 'Mixed FL: |B_c|.')
flags.DEFINE_string('central_optimizer', 'sgd', 'Mixed FL: CentralOpt.')
flags.DEFINE_float('central_learning_rate', 0.01, 'Mixed FL: eta_c.')
flags.DEFINE_float('merge_learning_rate', 1.0, 'Mixed FL: eta_m.')
flags.DEFINE_float('federated_weight', 0.5, 'Mixed FL: w_f.')
flags.DEFINE_float('central_weight', 0.5, 'Mixed FL: w_c.')
flags.DEFINE_boolean('mixed_diagnostics', False, 'Mixed FL: eq. 7 metrics.')
flags.DEFINE_float('proximal_strength', 0.01, 'FedProx: mu.')
flags.DEFINE_integer('scaffold_option', 2, 'SCAFFOLD: control variate option.')
flags.DEFINE_integer('pvr_last_layers', 1, 'FedPVR: layers with variates.')
flags.DEFINE_integer('fedres_option', 2, 'FedResAvg: option I or II.')
flags.DEFINE_float('local_learning_rate', 0.01, 'FedRes: lambda.')
flags.DEFINE_float('fedres_alpha', 1.0, 'FedResAvg: server step alpha.')
flags.DEFINE_boolean('fedres_fit_unseen', False,
                     'FedRes personalized eval: fit a never-sampled client\'s '
                     'local model for K steps on its train data.')

# Flags that only some algorithms use; each algorithm lists those it accepts.
ALGORITHM_FLAGS = (
    'client_optimizer', 'client_learning_rate', 'server_optimizer',
    'server_learning_rate', 'central_batch_size', 'central_optimizer',
    'central_learning_rate', 'merge_learning_rate', 'federated_weight',
    'central_weight', 'mixed_diagnostics', 'proximal_strength',
    'scaffold_option', 'pvr_last_layers', 'fedres_option',
    'local_learning_rate', 'fedres_alpha', 'fedres_fit_unseen')

FLAGS = flags.FLAGS


def all_values() -> dict:
  """Every flag this module defines, for hparams.json."""
  return {f.name: f.value for f in FLAGS.get_flags_for_module(__name__)}


def data_config() -> task_base.DataConfig:
  return task_base.DataConfig(
      client_batch_size=FLAGS.client_batch_size,
      client_steps=FLAGS.client_steps,
      client_epochs=FLAGS.client_epochs,
      central_batch_size=FLAGS.central_batch_size,
      central_steps=FLAGS.client_steps or 1,
      eval_batch_size=FLAGS.eval_batch_size,
      seed=FLAGS.seed,
      use_synthetic_data=FLAGS.use_synthetic_data,
      cache_dir=FLAGS.cache_dir,
      data_dir=FLAGS.data_dir,
      download=FLAGS.download,
      options={'celeba_mode': FLAGS.celeba_mode,
               'movielens_dir': FLAGS.movielens_dir,
               'heterogeneity': FLAGS.heterogeneity})


def algorithm_config(num_train_clients: int) -> algo_config.AlgorithmConfig:
  return algo_config.AlgorithmConfig(
      client_optimizer=FLAGS.client_optimizer,
      client_learning_rate=FLAGS.client_learning_rate,
      server_optimizer=FLAGS.server_optimizer,
      server_learning_rate=FLAGS.server_learning_rate,
      proximal_strength=FLAGS.proximal_strength,
      fedres_option=FLAGS.fedres_option,
      local_learning_rate=FLAGS.local_learning_rate,
      fedres_alpha=FLAGS.fedres_alpha,
      fedres_fit_unseen=FLAGS.fedres_fit_unseen,
      num_train_clients=num_train_clients,
      clients_per_round=FLAGS.clients_per_round)

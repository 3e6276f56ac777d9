r"""Trains one algorithm on one task; resumes from the run's checkpoints.

  python -m binaries.train --task=celeba_smile --algorithm=fedavg \
      --experiment_name=demo --use_synthetic_data --total_rounds=3
"""

from absl import flags
from absl import logging

from binaries import app
from binaries import flags_lib
from pipeline import driver
from pipeline import run_directory
from pipeline.errors import UsageError
from tasks import registry as task_registry
from tff_algos.aggregation import factories

FLAGS = flags.FLAGS
# --help lists the run, task and algorithm flags, not only this module's.
flags.adopt_module_key_flags(flags_lib)
flags.DEFINE_boolean(
    'allow_flag_changes', False,
    'Resume even though flags that change results differ from the run\'s '
    'hparams.json; the changes are recorded there (see README).')


def run_config() -> driver.RunConfig:
  return driver.RunConfig(
      root_output_dir=FLAGS.root_output_dir,
      experiment_name=FLAGS.experiment_name,
      total_rounds=FLAGS.total_rounds,
      clients_per_round=FLAGS.clients_per_round,
      rounds_per_eval=FLAGS.rounds_per_eval,
      rounds_per_checkpoint=FLAGS.rounds_per_checkpoint,
      seed=FLAGS.seed,
      client_state_dir=FLAGS.client_state_dir,
      clients_per_group=FLAGS.clients_per_group,
      runtime=FLAGS.runtime,
      allow_flag_changes=FLAGS.allow_flag_changes,
      batched_cohorts=FLAGS.batched_cohorts)


def main(argv):
  del argv
  app.require_flags('task', 'algorithm', 'experiment_name')
  # Before the (slow) task and algorithm builds.
  run_directory.run_dir_path(FLAGS.root_output_dir, FLAGS.experiment_name)
  flags_lib.require_known_names()
  task_defaults = flags_lib.apply_task_defaults(FLAGS.task)
  flags_lib.check_runtime_flags()
  on_tff = FLAGS.runtime == 'tff'  # The native runtime never starts TFF's.
  if on_tff:
    # The task's own cohort is known once it is built.
    flags_lib.check_execution_flags(FLAGS.clients_per_round if FLAGS[
        'clients_per_round'].present else None)
  task = task_registry.build_task(FLAGS.task, flags_lib.data_config())
  flags_lib.apply_built_task_defaults(task)
  config = run_config()
  config.validate(task.num_train_clients)
  if on_tff:
    # Checked before any context is built: each takes file descriptors.
    flags_lib.check_execution_flags(config.clients_per_round)
    flags_lib.configure_execution()
  definition = flags_lib.build_algorithm(task)
  if FLAGS['client_state_dir'].present and not definition.has_client_state:
    raise UsageError(f'--client_state_dir does not apply to --algorithm='
                     f'{FLAGS.algorithm}: it keeps no per-client state')
  aggregation = flags_lib.aggregator_settings(task)
  hparams = flags_lib.all_values()
  # Which values came from the task's defaults rather than the command line.
  hparams['task_defaults_applied'] = task_defaults
  result = driver.train(
      definition, task, config, hparams,
      model_aggregator=factories.build(aggregation, config.clients_per_round),
      round_metrics=flags_lib.privacy_metrics(aggregation, task),
      hparams_defaults=flags_lib.given_flag_defaults(definition),
      hparams_unused=flags_lib.unused_algorithm_flags(FLAGS.algorithm),
      hparams_fixed=flags_lib.fixed_on_resume(definition),
      hparams_check=flags_lib.check_stored_values)
  summary = ', '.join(f'{k}={v:.4f}' for k, v in sorted(
      result.last_metrics.items()) if k.startswith(('train/loss', 'eval')))
  logging.info('finished round %d: %s', result.round_num, summary)
  # A finished run re-run trains no round: there is no new row to show.
  print(f'{config.run_dir}: round {result.round_num} '
        f'{summary or "(already trained; nothing to do)"}')


if __name__ == '__main__':
  app.run(main)

"""Evaluates a run's checkpoint (default: the latest) or an export.

  python -m binaries.evaluate --experiment_name=demo [--root_output_dir=runs]
      [--checkpoint_round=N | --export_dir=DIR]
      [--conformal [--conformal_alphas=0.05,0.1] [--calibration_fraction=0.5]]

Prints the task's evaluation metrics as JSON and writes them to
<run>/evaluation_round_<N>.json (or, for an export, beside it:
<export_dir>/../evaluation_<export_dir's name>.json, i.e.
<run>/evaluation_export.json for the run's own export).
A FedRes checkpoint's report also holds eval_personalized/* (each client's
global model plus its own theta_i of that round), as training logs them;
an export is evaluated as the global model only.

--conformal adds split conformal prediction (pipeline.conformal) on the task's
evaluation data held by the server: a seeded random `--calibration_fraction`
of it calibrates the threshold, the rest measures coverage and mean set size
for every miscoverage level; the rows go into the JSON report, into
<output>.conformal.csv, and as a table on stderr.
"""

import csv
import dataclasses
import io
import json
import os
import sys

from absl import flags

from binaries import app
from binaries import flags_lib
from binaries import restore
from pipeline import conformal
from pipeline import evaluation
from pipeline import export as export_lib
from pipeline import run_directory
from pipeline import run_logs
from pipeline.errors import UsageError

FLAGS = flags.FLAGS
# --help lists the run, task and algorithm flags, not only this module's.
flags.adopt_module_key_flags(flags_lib)
flags.DEFINE_string('export_dir', None,
                    'Evaluate this export instead of a checkpoint.')
flags_lib.refuse_empty('export_dir')
flags_lib.require_utf8('export_dir')
flags.DEFINE_boolean('conformal', False,
                     'Also report split conformal prediction sets: coverage '
                     'and mean set size per miscoverage level.')
flags.DEFINE_list('conformal_alphas',
                  [str(a) for a in conformal.DEFAULT_ALPHAS],
                  'Miscoverage levels alpha in (0, 1) for --conformal.')
flags.DEFINE_float('calibration_fraction', 0.5,
                   'Share of the evaluation data used for conformal '
                   'calibration (the rest is the test part), in (0, 1).')


def _conformal_alphas() -> list[float]:
  try:
    alphas = [float(a) for a in FLAGS.conformal_alphas]
  except ValueError as e:
    raise UsageError(f'--conformal_alphas must be numbers in (0, 1): {e}') from e
  bad = [a for a in alphas if not 0.0 < a < 1.0]
  if not alphas or bad:
    raise UsageError(f'--conformal_alphas must be numbers in (0, 1), got '
                     f'{",".join(FLAGS.conformal_alphas)}')
  return alphas


def require_classifier(task) -> None:
  """UsageError unless `task` predicts one class per example, which is what
  conformal sets are over (a regression or a sequence model failed with an
  IndexError)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  loss = task.loss_fn()
  label = tf.nest.flatten(task.batch_spec[1])
  per_example = len(label) == 1 and (
      label[0].shape.rank == 1 or label[0].shape.as_list()[1:] == [1])
  if not isinstance(loss, (tf.keras.losses.BinaryCrossentropy,
                           tf.keras.losses.SparseCategoricalCrossentropy)):
    problem = f'its loss is {type(loss).__name__}, not a cross-entropy'
  elif not per_example:
    problem = 'it predicts a sequence of classes per example, not one'
  else:
    return
  raise UsageError(f'--conformal needs a classifier of one class per example; '
                   f'--task={task.name} is not one ({problem})')


def conformal_evaluation(task, weights, alphas: list[float]) -> dict:
  """Conformal rows on the task's main evaluation set, split by --seed."""
  if not 0.0 < FLAGS.calibration_fraction < 1.0:
    raise UsageError('--calibration_fraction must be in (0, 1), got '
                     f'{FLAGS.calibration_fraction}')
  datasets = task.eval_datasets_fn()
  name = '' if '' in datasets else next(iter(datasets))
  model = evaluation.keras_model_with_weights(task, weights)
  from_logits = bool(task.loss_fn().get_config().get('from_logits', False))
  # One pass over the data, then a split of the predictions: the evaluation
  # stream need not be in the same order twice.
  probabilities, labels = conformal.predict(model, datasets[name], from_logits)
  try:
    calibration, test = conformal.split_indices(
        len(labels), FLAGS.calibration_fraction, FLAGS.seed)
  except ValueError as e:
    raise UsageError(f'--calibration_fraction: {e}') from e
  rows = conformal.conformal_table(probabilities[calibration],
                                   labels[calibration], probabilities[test],
                                   labels[test], alphas)
  test_accuracy = float(
      (probabilities[test].argmax(axis=1) == labels[test]).mean())
  return {'eval_set': name or 'eval', 'test_top1_accuracy': test_accuracy,
          'rows': [dataclasses.asdict(row) for row in rows]}


def _write_conformal(report: dict, path: str) -> None:
  rows = report['rows']
  text = io.StringIO()
  writer = csv.DictWriter(text, fieldnames=list(rows[0]))
  writer.writeheader()
  writer.writerows(rows)
  # Whole or not at all: a full disk emptied an earlier report.
  run_logs.replace_file(path, text.getvalue())
  print(f'conformal sets on {report["eval_set"]} (test top-1 accuracy '
        f'{report["test_top1_accuracy"]:.4f}):', file=sys.stderr)
  print(f'{"alpha":>8} {"1-alpha":>8} {"coverage":>9} {"mean size":>10} '
        f'{"threshold":>10}', file=sys.stderr)
  for row in rows:
    print(f'{row["alpha"]:8.3f} {1 - row["alpha"]:8.3f} '
          f'{row["coverage"]:9.4f} {row["mean_set_size"]:10.3f} '
          f'{row["threshold"]:10.4f}', file=sys.stderr)


def _personalized_metrics(checkpoint, task) -> dict:
  """eval_personalized/* of the checkpoint, as training logged them: FedRes
  evaluates each client with the global model plus its own theta_i, the
  states the checkpoint's round committed."""
  # No trainer may write the client states meanwhile.
  with run_directory.locked(restore.run_dir(), writable=False):
    states = restore.client_states(checkpoint, task)
    return evaluation.flatten_metrics(
        checkpoint.definition.personalization.evaluate(
            checkpoint.state['server_state'], states), 'eval_personalized/')


def main(argv):
  del argv
  app.require_flags('experiment_name')
  # Each was silently ignored.
  if FLAGS.export_dir and FLAGS['checkpoint_round'].present:
    raise UsageError('--checkpoint_round does not apply with --export_dir (the '
                     'export is evaluated, not a checkpoint); pass one of them')
  for name in ('conformal_alphas', 'calibration_fraction'):
    if FLAGS[name].present and not FLAGS.conformal:
      raise UsageError(f'--{name} does not apply without --conformal')
  alphas = _conformal_alphas() if FLAGS.conformal else None
  restore.load_run_flags()
  task = restore.build_task()
  if FLAGS.conformal:
    require_classifier(task)
  checkpoint = None
  if FLAGS.export_dir:
    weights = export_lib.load_model_weights(FLAGS.export_dir, task)
    # Beside the export, named after it: the run's own export/ gives
    # <run>/evaluation_export.json, another run's export goes to that run.
    export_dir = os.path.normpath(os.path.abspath(FLAGS.export_dir))
    output = os.path.join(os.path.dirname(export_dir),
                          f'evaluation_{os.path.basename(export_dir)}.json')
    source = {'export_dir': FLAGS.export_dir}
  else:
    checkpoint = restore.load_checkpoint(task)
    weights = checkpoint.model_weights
    output = os.path.join(restore.run_dir(),
                          f'evaluation_round_{checkpoint.round_num}.json')
    source = {'checkpoint_round': checkpoint.round_num}
  metrics = evaluation.Evaluator(task)(weights)
  if checkpoint is not None and checkpoint.definition.personalization:
    metrics.update(_personalized_metrics(checkpoint, task))
  report = {**source, **metrics}
  if FLAGS.conformal:
    report['conformal'] = conformal_evaluation(task, weights, alphas)
  # Printed before the files are written: on a full or read-only disk the
  # write fails (status 3), and the metrics computed are still shown.
  print(json.dumps(report, sort_keys=True), flush=True)
  if FLAGS.conformal:
    _write_conformal(report['conformal'],
                     os.path.splitext(output)[0] + '.conformal.csv')
  run_logs.replace_file(output, json.dumps(report, indent=2, sort_keys=True))


if __name__ == '__main__':
  app.run(main)

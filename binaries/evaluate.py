"""Evaluates a run's checkpoint (default: the latest) or an export.

  python -m binaries.evaluate --experiment_name=demo [--root_output_dir=runs]
      [--checkpoint_round=N | --export_dir=DIR]

Prints the task's evaluation metrics as JSON and writes them to
<run>/evaluation_round_<N>.json (or <export_dir>/../evaluation_export.json).
"""

import json
import os

from absl import flags

from binaries import app
from binaries import flags_lib  # pylint: disable=unused-import
from binaries import restore
from pipeline import evaluation
from pipeline import export as export_lib
from pipeline.errors import UsageError

FLAGS = flags.FLAGS
flags.DEFINE_string('export_dir', None,
                    'Evaluate this export instead of a checkpoint.')


def main(argv):
  del argv
  app.require_flags('experiment_name')
  restore.load_run_flags()
  task = restore.build_task()
  if FLAGS.export_dir:
    if not os.path.isfile(os.path.join(FLAGS.export_dir, 'saved_model.pb')):
      raise UsageError(f'--export_dir={FLAGS.export_dir} holds no SavedModel')
    weights = export_lib.load_model_weights(FLAGS.export_dir)
    output = os.path.join(restore.run_dir(), 'evaluation_export.json')
    source = {'export_dir': FLAGS.export_dir}
  else:
    round_num, weights = restore.load_checkpoint_weights(task)
    output = os.path.join(restore.run_dir(),
                          f'evaluation_round_{round_num}.json')
    source = {'checkpoint_round': round_num}
  metrics = evaluation.Evaluator(task)(weights)
  report = {**source, **metrics}
  with open(output, 'w') as f:
    json.dump(report, f, indent=2, sort_keys=True)
  print(json.dumps(report, sort_keys=True))


if __name__ == '__main__':
  app.run(main)

"""Exports a run's checkpoint (default: the latest) as a SavedModel.

  python -m binaries.export --experiment_name=demo [--root_output_dir=runs]
      [--checkpoint_round=N] [--export_dir=DIR (default <run>/export)]
"""

import os

from absl import flags

from binaries import app
from binaries import flags_lib  # pylint: disable=unused-import
from binaries import restore
from pipeline import export as export_lib

FLAGS = flags.FLAGS
flags.DEFINE_string('export_dir', None, 'Where to write (default <run>/export).')


def main(argv):
  del argv
  app.require_flags('experiment_name')
  restore.load_run_flags()
  task = restore.build_task()
  round_num, weights = restore.load_checkpoint_weights(task)
  export_dir = FLAGS.export_dir or os.path.join(restore.run_dir(), 'export')
  path = export_lib.export_saved_model(task, weights, export_dir)
  print(f'exported round {round_num} to {path}')


if __name__ == '__main__':
  app.run(main)

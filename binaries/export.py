"""Exports a run's checkpoint (default: the latest) as a SavedModel.

  python -m binaries.export --experiment_name=demo [--root_output_dir=runs]
      [--checkpoint_round=N] [--export_dir=DIR (default <run>/export)]

A FedRes run's export also holds the personal models of the checkpoint (as
training's own export does). The export replaces only an earlier export:
--export_dir may not be the run directory or inside it (other than its
export/), lie inside another run's directory, hold a run, or hold anything
an export of this pipeline does not write. Nothing but the replaced export
is deleted (the new one is staged in a directory of a unique name).
"""

import os

from absl import flags

from binaries import app
from binaries import flags_lib
from binaries import restore
from pipeline import driver
from pipeline import export as export_lib
from pipeline import run_directory

FLAGS = flags.FLAGS
# --help lists the run, task and algorithm flags, not only this module's.
flags.adopt_module_key_flags(flags_lib)
flags.DEFINE_string('export_dir', None, 'Where to write (default <run>/export).')
flags_lib.refuse_empty('export_dir')
flags_lib.require_utf8('export_dir')


def main(argv):
  del argv
  app.require_flags('experiment_name')
  run_dir = restore.run_dir()
  export_dir = FLAGS.export_dir or os.path.join(run_dir, export_lib.EXPORT_DIR)
  export_lib.check_export_dir(export_dir, run_dir)
  restore.load_run_flags()
  # No trainer may write the run (or its export) meanwhile.
  with run_directory.locked(run_dir, writable=False):
    task = restore.build_task()
    checkpoint = restore.load_checkpoint(task)
    states = None
    if checkpoint.definition.personalization is not None:
      states = restore.client_states(checkpoint, task)
    path = export_lib.export_saved_model(
        task, checkpoint.model_weights, export_dir,
        driver.personal_models_writer(
            checkpoint.definition, checkpoint.state['server_state'], states))
  print(f'exported round {checkpoint.round_num} to {path}')


if __name__ == '__main__':
  app.run(main)

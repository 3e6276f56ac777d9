"""Entry-point wrapper shared by the binaries.

Bad input (UsageError, or a flag value absl rejects) ends with one line
`error: ...` on stderr and exit status 2, no traceback; TFF's worker process is
stopped on every exit path.
"""

import sys

from absl import app
from absl import flags
from absl import logging

from pipeline import tff_runtime
from pipeline.errors import UsageError

EXIT_USAGE = 2


def run(main, allow_positional_args: bool = False) -> None:
  tff_runtime.install_shutdown_hooks()

  def guarded_main(argv):
    if len(argv) > 1 and not allow_positional_args:
      raise UsageError(f'unexpected positional arguments: {argv[1:]}')
    if not flags.FLAGS['verbosity'].present:
      logging.set_verbosity(logging.WARNING)
      # Only binaries that use TF have imported it; others (plot) stay light.
      tf = sys.modules.get('tensorflow')
      if tf is not None:
        tf.get_logger().setLevel('WARNING')
    try:
      return main(argv)
    except UsageError as e:
      print(f'error: {e}', file=sys.stderr)
      tff_runtime.shutdown_workers()
      sys.exit(EXIT_USAGE)

  def parse_flags(argv):
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      print(f'error: {e}', file=sys.stderr)
      sys.exit(EXIT_USAGE)

  try:
    app.run(guarded_main, flags_parser=parse_flags)
  finally:
    tff_runtime.shutdown_workers()


def require_flags(*names: str) -> None:
  missing = [name for name in names if flags.FLAGS[name].value is None]
  if missing:
    raise UsageError('missing required flag(s): ' +
                     ', '.join(f'--{name}' for name in missing))


def check_flags_apply(owner: str, accepted: tuple[str, ...],
                      candidates: tuple[str, ...]) -> None:
  """Each of `candidates` set on the command line must be one `owner` (e.g.
  'algorithm=fedavg', 'task=digits') uses: a flag it would ignore is an error,
  not a silent no-op."""
  for name in candidates:
    if flags.FLAGS[name].present and name not in accepted:
      allowed = ', '.join(f'--{n}' for n in accepted) or 'none'
      raise UsageError(f'--{name} does not apply to --{owner} '
                       f'(its flags: {allowed})')

r"""Curves of one metric against rounds for several runs, in one PNG.

  python -m binaries.plot runs/mixed_pt runs/mixed_1wgt runs/fl_only \
      --metric=eval/auc --output=auc.png

Each positional argument is a run directory (<root_output_dir>/<name>) made
by binaries.train; its curve is labelled with the directory's name (or
--labels). Rounds where the metric was not computed (e.g. no evaluation) are
skipped.
"""

import csv
import io
import math
import os

from absl import flags

from binaries import app
from pipeline import run_logs
from pipeline.errors import ENVIRONMENT_ERRNOS
from pipeline.errors import EnvironmentFault
from pipeline.errors import first_line
from pipeline.errors import UsageError

FLAGS = flags.FLAGS
flags.DEFINE_string('metric', 'eval/auc', 'Column of metrics.csv to plot.')
flags.DEFINE_string('output', None, 'PNG file to write.')
flags.DEFINE_list('labels', None,
                  'Curve labels, one per run directory (default: names).')
flags.DEFINE_string('title', None, 'Plot title (default: the metric).')

ROUND_COLUMN = 'round_num'


def read_curve(run_dir: str, metric: str) -> tuple[list[int], list[float]]:
  """(rounds, values) of `metric` in `run_dir`/metrics.csv."""
  path = os.path.join(run_dir, 'metrics.csv')
  if not os.path.isfile(path):
    raise UsageError(f'{path} not found: each argument must be a run '
                     'directory written by binaries.train')
  try:
    with open(path, newline='', encoding='utf-8') as f:
      text = f.read()
    # A last line without its newline is a row the trainer is appending
    # (a plot of a run in progress); its value may be cut short.
    reader = csv.DictReader(io.StringIO(text[:text.rfind('\n') + 1]))
    columns = reader.fieldnames or []
    if ROUND_COLUMN not in columns:
      raise UsageError(f'{path} is not a metrics file of binaries.train '
                       f'(it has no {ROUND_COLUMN} column)')
    if metric not in columns:
      available = ', '.join(c for c in columns if c != ROUND_COLUMN)
      raise UsageError(f'--metric={metric} is not a column of {path}; '
                       f'allowed: {available}')
    points = []
    for row in reader:
      if row.get(metric) in (None, ''):
        continue
      try:
        round_num = int(row[ROUND_COLUMN])
        # matplotlib takes rounds as floats: a larger one was an
        # OverflowError traceback.
        if not 0 <= round_num <= 2**53:
          raise ValueError(f'round {round_num} is out of range')
        points.append((round_num, float(row[metric])))
      except (ValueError, TypeError) as e:
        raise UsageError(
            f'{path} line {reader.line_num}: {ROUND_COLUMN}='
            f'{row[ROUND_COLUMN]!r}, {metric}={row[metric]!r} are not a '
            'round and a number') from e
  except (UnicodeDecodeError, csv.Error) as e:
    raise UsageError(f'{path} is not a metrics file of binaries.train '
                     f'({type(e).__name__}: {first_line(e)})') from e
  if not points:
    raise UsageError(f'{path} has no values of --metric={metric}')
  finite = [v for _, v in points if math.isfinite(v)]
  if finite and not math.isfinite(max(finite) - min(finite)):
    # matplotlib's tick locator failed on such a span: an IndexError
    # traceback. A metric of float32 math never spans that far.
    raise UsageError(f'{path} holds --metric={metric} values from '
                     f'{min(finite):g} to {max(finite):g}, a span no plot '
                     'axis holds; binaries.train writes no such values')
  points.sort()
  return [r for r, _ in points], [v for _, v in points]


def check_math_text(text: str, what: str) -> None:
  """UsageError if matplotlib takes `text` (`what`: where it comes from)
  for math (between two `$`) that it cannot parse: savefig raised the parse
  error, a traceback."""
  from matplotlib import cbook  # pylint: disable=g-import-not-at-top
  from matplotlib import mathtext  # pylint: disable=g-import-not-at-top
  try:
    for line in text.split('\n'):  # As matplotlib draws it.
      if cbook.is_math_text(line):
        mathtext.MathTextParser('path').parse(line)
  except ValueError as e:
    shown = f"'{text}'" if text.isprintable() else repr(text)
    raise UsageError(f'{what} {shown} is not text matplotlib can draw: '
                     'between two $ it is math '
                     f'({str(e).strip().splitlines()[-1]}); write a $ as '
                     '\\$') from e


def plot(run_dirs: list[str], metric: str, output: str,
         labels: list[str], title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top

  check_math_text(title, '--title' if FLAGS.title else 'the title (--metric)')
  if FLAGS.title:  # Else checked as the title.
    check_math_text(metric, '--metric (the y axis\'s label)')
  for label in labels:
    check_math_text(label, 'the label' if FLAGS.labels else
                    'the label (a run directory\'s name; --labels)')
  # Every file is read before anything is written.
  curves = [read_curve(run_dir, metric) for run_dir in run_dirs]
  figure, axes = plt.subplots(figsize=(6.4, 4.2))
  for (rounds, values), label in zip(curves, labels):
    axes.plot(rounds, values, label=label, marker='.' if len(rounds) < 30
              else None)
  axes.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  axes.set_xlabel('round')
  axes.set_ylabel(metric)
  axes.set_title(title)
  axes.grid(alpha=0.3)
  axes.legend()
  figure.tight_layout()
  directory = os.path.dirname(os.path.abspath(output))
  if os.path.isdir(output):
    raise UsageError(f'--output={output} is a directory')
  try:
    os.makedirs(directory, exist_ok=True)
  except (FileExistsError, NotADirectoryError) as e:
    raise UsageError(f'--output={output} cannot be written: {e.filename} '
                     'is a file, not a directory') from e
  # Rendered whole before the file is written (savefig writes as it
  # renders): a Ctrl-C or a full disk keeps the image it would replace.
  image = io.BytesIO()
  figure.savefig(image, format='png', dpi=100)
  try:
    run_logs.replace_file(output, image.getvalue())
  except OSError as e:
    if e.errno in ENVIRONMENT_ERRNOS:
      raise  # binaries.app names these faults with the path.
    # E.g. a place the kernel will not make files in (/proc).
    raise EnvironmentFault(f'--output={output} cannot be written '
                           f'({e.strerror}); use another --output') from None
  plt.close(figure)


def main(argv):
  run_dirs = argv[1:]
  if not run_dirs:
    raise UsageError('pass one or more run directories, e.g. '
                     'python -m binaries.plot runs/a runs/b --output=a.png')
  app.require_flags('output')
  if not FLAGS.output.lower().endswith('.png'):
    raise UsageError(f'--output={FLAGS.output} must be a .png file')
  labels = FLAGS.labels or [os.path.basename(os.path.normpath(d))
                            for d in run_dirs]
  if len(labels) != len(run_dirs):
    raise UsageError(f'--labels has {len(labels)} labels for '
                     f'{len(run_dirs)} run directories')
  plot(run_dirs, FLAGS.metric, FLAGS.output, labels,
       FLAGS.title or FLAGS.metric)
  print(f'wrote {FLAGS.output}')


if __name__ == '__main__':
  app.run(main, allow_positional_args=True)

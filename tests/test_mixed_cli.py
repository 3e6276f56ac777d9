"""Per-task flag defaults, binaries.plot, and a mixed FL usage error of train."""

import csv
import os
import subprocess
import sys

import pytest
from absl import flags

from binaries import flags_lib
import fault_testlib

FLAGS = flags.FLAGS


@pytest.fixture
def parse_flags():
  """Parses a command line into absl FLAGS; restores defaults afterwards."""

  def parse(*args):
    FLAGS.unparse_flags()
    FLAGS(['train', *args])

  yield parse
  FLAGS.unparse_flags()


def test_celeba_defaults_are_the_papers(parse_flags):
  parse_flags('--task=celeba_smile', '--algorithm=mixed_pt')
  applied = flags_lib.apply_task_defaults('celeba_smile')
  expected = dict(clients_per_round=100, client_batch_size=5, client_steps=2,
                  client_learning_rate=0.01, server_learning_rate=1.0,
                  central_batch_size=500, central_learning_rate=0.01,
                  merge_learning_rate=1.0, federated_weight=0.5,
                  central_weight=0.5)
  assert applied == expected
  for name, value in expected.items():
    assert FLAGS[name].value == pytest.approx(value), name


def test_task_defaults_yield_to_the_command_line(parse_flags):
  parse_flags('--task=celeba_smile', '--algorithm=mixed_1wgt',
              '--client_learning_rate=0.05', '--server_learning_rate=2',
              '--client_epochs=3', '--use_synthetic_data')
  applied = flags_lib.apply_task_defaults('celeba_smile')
  assert 'client_learning_rate' not in applied
  # --client_epochs was chosen instead of K.
  assert 'client_steps' not in applied and FLAGS.client_steps is None
  assert applied['central_batch_size'] == 1000  # 1-w GT: one K*S*|B_i| batch
  # eta_c = eta * eta_s, from the user's values.
  assert applied['central_learning_rate'] == pytest.approx(0.1)
  assert applied['clients_per_round'] == 10  # synthetic: 20 clients


def test_unknown_task_has_no_defaults(parse_flags):
  parse_flags('--task=other')
  assert flags_lib.apply_task_defaults('other') == {}


def _run(module, *args):
  return fault_testlib.run_binary(module, *args)


# binaries.train imported once for its usage errors (each run still a
# process of its own; see preloaded_binary).
train_binary = fault_testlib.preloaded_runs('binaries.train')


def _write_run(run_dir, aucs):
  os.makedirs(run_dir)
  with open(os.path.join(run_dir, 'metrics.csv'), 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(['round_num', 'eval/auc', 'train/loss'])
    for round_num, auc in enumerate(aucs, start=1):
      writer.writerow([round_num, '' if auc is None else auc, 0.5])


def test_plot_writes_one_png_of_several_runs(tmp_path):
  _write_run(tmp_path / 'a', [0.5, None, 0.7])
  _write_run(tmp_path / 'b', [0.6, 0.8, 0.9])
  output = tmp_path / 'plots' / 'auc.png'
  result = _run('binaries.plot', str(tmp_path / 'a'), str(tmp_path / 'b'),
                '--metric=eval/auc', f'--output={output}')
  assert result.returncode == 0, result.stderr
  with open(output, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_plot_of_a_run_in_progress_leaves_out_the_row_being_appended(
    tmp_path):
  # The trainer appends a row in pieces: a read that fell inside
  # '3,0.8125' plotted round 3 at 0.0 ('3,0.') or 0.8 ('3,0.8').
  from binaries import plot  # pylint: disable=import-outside-toplevel
  (tmp_path / 'a').mkdir()
  for tail in ('3,0.', '3,0.8', '3'):
    (tmp_path / 'a' / 'metrics.csv').write_text(
        f'round_num,eval/auc\r\n1,0.5\r\n2,0.75\r\n{tail}')
    assert plot.read_curve(str(tmp_path / 'a'), 'eval/auc') == ([1, 2],
                                                                [0.5, 0.75])


def _assert_plot_refuses(run_dir, metric, error):
  """plot of `run_dir`'s `metric` exits 2 with the one line `error: <error>`
  and writes no image."""
  output = run_dir.parent / 'x.png'
  result = _run('binaries.plot', str(run_dir), f'--metric={metric}',
                f'--output={output}')
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [f'error: {error}']
  assert not output.exists()


def test_plot_rejects_an_unknown_metric(tmp_path):
  _write_run(tmp_path / 'a', [0.5])
  _assert_plot_refuses(
      tmp_path / 'a', 'eval/nope', '--metric=eval/nope is not a column of '
      f'{tmp_path / "a" / "metrics.csv"}; allowed: eval/auc, train/loss')


@pytest.mark.parametrize('content, error', [
    (b'\xff\xfe round', "is not a metrics file of binaries.train "
     "(UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position "
     '0: invalid start byte)'),
    (b'round_num,eval/auc\n1,0.5\nx,0.6\n', "line 3: round_num='x', "
     "eval/auc='0.6' are not a round and a number"),
    (b'round_num,eval/auc\n1,abc\n', "line 2: round_num='1', "
     "eval/auc='abc' are not a round and a number"),
    # Was a KeyError traceback.
    (b'round,eval/auc\n1,0.5\n', 'is not a metrics file of binaries.train '
     '(it has no round_num column)'),
    # Was an OverflowError traceback in matplotlib.
    (b'round_num,eval/auc\n1%s,0.5\n' % (b'0' * 309), "line 2: round_num='1%s'"
     ", eval/auc='0.5' are not a round and a number" % ('0' * 309)),
    # Was an IndexError traceback in matplotlib's tick locator.
    (b'round_num,eval/auc\n1,1e308\n2,-1e308\n', 'holds --metric=eval/auc '
     'values from -1e+308 to 1e+308, a span no plot axis holds; '
     'binaries.train writes no such values'),
])
def test_plot_refuses_a_damaged_metrics_file(tmp_path, content, error):
  (tmp_path / 'a').mkdir()
  (tmp_path / 'a' / 'metrics.csv').write_bytes(content)
  _assert_plot_refuses(tmp_path / 'a', 'eval/auc',
                       f'{tmp_path / "a" / "metrics.csv"} {error}')


def test_plot_refuses_math_text_matplotlib_cannot_parse(tmp_path):
  # savefig raised matplotlib's parse error: a traceback, status 1.
  _write_run(tmp_path / 'a', [0.5])
  output = tmp_path / 'x.png'
  result = _run('binaries.plot', str(tmp_path / 'a'), '--metric=eval/auc',
                f'--output={output}', '--labels=$\\foo$',
                '--title=$\\eta$ of 5\\$')
  assert (result.returncode, result.stderr) == (
      2, "error: the label '$\\foo$' is not text matplotlib can draw: "
      'between two $ it is math (ParseFatalException: Unknown symbol: \\foo, '
      "found '\\'  (at char 0), (line:1, col:1)); write a $ as \\$\n")
  assert not output.exists()


def test_plot_refuses_a_metric_name_matplotlib_cannot_draw(tmp_path):
  # With --title, the metric is only the y axis's label: a traceback.
  (tmp_path / 'a').mkdir()
  (tmp_path / 'a' / 'metrics.csv').write_text('round_num,$\\foo$\n1,0.5\n')
  output = tmp_path / 'x.png'
  result = _run('binaries.plot', str(tmp_path / 'a'), '--metric=$\\foo$',
                f'--output={output}', '--title=ok')
  assert (result.returncode, result.stderr) == (
      2, "error: --metric (the y axis's label) '$\\foo$' is not text "
      'matplotlib can draw: between two $ it is math (ParseFatalException: '
      "Unknown symbol: \\foo, found '\\'  (at char 0), (line:1, col:1)); "
      'write a $ as \\$\n')
  assert not output.exists()


@pytest.mark.parametrize('output', ['file/x.png', 'dir.png'])
def test_plot_refuses_an_output_it_cannot_write(tmp_path, output):
  _write_run(tmp_path / 'a', [0.5])
  (tmp_path / 'file').write_text('not a directory')
  (tmp_path / 'dir.png').mkdir()
  result = _run('binaries.plot', str(tmp_path / 'a'), '--metric=eval/auc',
                f'--output={tmp_path / output}')
  assert result.returncode == 2
  expected = (f'{tmp_path / "file"} is a file, not a directory'
              if output.startswith('file') else 'is a directory')
  [line] = result.stderr.strip().splitlines()
  assert line.startswith(f'error: --output={tmp_path / output}')
  assert line.endswith(expected)


def test_plot_output_where_nothing_can_be_written_is_an_environment_fault(
    tmp_path):
  # The kernel makes no files in /proc (ENOENT): a FileNotFoundError
  # traceback.
  _write_run(tmp_path / 'a', [0.5])
  result = _run('binaries.plot', str(tmp_path / 'a'), '--metric=eval/auc',
                '--output=/proc/x.png')
  assert (result.returncode, result.stderr) == (
      3, 'error: --output=/proc/x.png cannot be written (No such file or '
      'directory); use another --output\n')


def test_plot_cut_short_keeps_the_image_it_would_replace(tmp_path):
  # savefig wrote the --output file as it rendered: a Ctrl-C (or a full
  # disk) meanwhile left a cut-off PNG where the last plot was.
  _write_run(tmp_path / 'a', [0.5])
  output = tmp_path / 'auc.png'
  output.write_bytes(b'the last plot')
  script = tmp_path / 'interrupted_plot.py'
  script.write_text(
      'import runpy, sys\n'
      'from matplotlib import figure\n'
      'def savefig(self, target, **kwargs):\n'
      '  if isinstance(target, str):\n'
      '    target = open(target, "wb")\n'
      '  target.write(b"\\x89PNG cut")\n'
      '  target.flush()\n'
      '  raise KeyboardInterrupt\n'
      'figure.Figure.savefig = savefig\n'
      f'sys.argv = ["plot", {str(tmp_path / "a")!r}, "--metric=eval/auc", '
      f'"--output={output}"]\n'
      'runpy.run_module("binaries.plot", run_name="__main__", '
      'alter_sys=True)\n')
  result = subprocess.run(
      [sys.executable, str(script)], cwd=fault_testlib.REPO,
      env=fault_testlib.environment(),
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 130, result.stderr[-3000:]
  assert result.stderr.splitlines() == [
      'error: interrupted; what it had not finished was not written: re-run '
      'the same command'], result.stderr[-3000:]
  assert output.read_bytes() == b'the last plot'
  assert sorted(os.listdir(tmp_path)) == ['a', 'auc.png',
                                          'interrupted_plot.py']


def test_train_explains_that_pt_needs_k(train_binary, tmp_path):
  result = train_binary('--task=celeba_smile', '--algorithm=mixed_pt',
                        '--use_synthetic_data', '--client_epochs=1',
                        '--experiment_name=no_k',
                        f'--root_output_dir={tmp_path}')
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
      'error: --algorithm=mixed_pt needs --client_steps (K): its central '
      'model takes K steps per round')
  assert not (tmp_path / 'no_k').exists()


@pytest.mark.parametrize('flags,rejected', [
    (['--client_optimizer=adam'], '--client_optimizer=adam'),
    (['--client_optimizer=sgdm', '--central_optimizer=adam'],
     '--client_optimizer=sgdm, --central_optimizer=adam')])
def test_two_way_gt_rejects_optimizers_other_than_plain_sgd(
    train_binary, tmp_path, flags, rejected):
  result = train_binary('--task=celeba_smile', '--algorithm=mixed_2wgt',
                        '--use_synthetic_data', '--experiment_name=adam',
                        f'--root_output_dir={tmp_path}', *flags)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      'error: --algorithm=mixed_2wgt needs plain SGD as --client_optimizer '
      'and --central_optimizer (its augmenting gradients are recovered from '
      'the deltas of plain SGD steps; docs/mixed_fl.md); got ' + rejected]
  assert not (tmp_path / 'adam').exists()


@pytest.mark.parametrize('args, expected', [
    (('--client_steps=2', '--central_steps=4'), 4),  # J > K: not cut to K.
    (('--client_steps=3', '--central_steps=2'), 2),
    (('--client_steps=3',), 3),  # Default J = K.
])
def test_central_data_holds_the_central_models_steps(parse_flags, args,
                                                     expected):
  parse_flags('--task=celeba_smile', '--algorithm=mixed_pt',
              '--use_synthetic_data', *args)
  assert flags_lib.data_config().central_steps == expected

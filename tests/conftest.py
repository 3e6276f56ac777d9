"""Test-session set-up: TFF's local runtime, and no worker left behind."""

import os
import signal
import warnings

import pytest

from pipeline import tf_logs

tf_logs.quiet_tensorflow_import()  # Before anything imports TensorFlow.

from pipeline import private_temp  # pylint: disable=g-import-not-at-top,wrong-import-position
from pipeline import tff_runtime  # pylint: disable=g-import-not-at-top,wrong-import-position


# The slowest test takes under a minute; a hung one (e.g. waiting on a TFF
# worker) fails after this instead of using up CI's 90 minutes.
TEST_TIME_LIMIT_SECONDS = 600


class TestTimeLimitExceeded(Exception):
  """Raised inside a test that runs longer than its time limit."""


def pytest_configure(config):
  # The suite runs three test processes on the cores (scripts/test.sh): a
  # native run's lanes, each tracing its own group computation, would only
  # compete with the other processes. Results do not depend on it
  # (test_native_runtime checks); the binaries the tests start inherit it.
  from tff_algos.runtime import cohort  # pylint: disable=g-import-not-at-top
  os.environ.setdefault(cohort.CONCURRENT_LANES_ENV, '1')
  config.addinivalue_line(
      'markers', 'time_limit(seconds): this test\'s time limit')
  # TF/TFF dependencies warn about distutils at import; not ours to fix.
  warnings.filterwarnings('ignore', category=DeprecationWarning)
  tff_runtime.configure_execution()


@pytest.fixture(autouse=True)
def _time_limit(request):
  # SIGALRM's handler runs in the main thread and raises there, so the test
  # fails through its normal teardown (TFF workers are stopped as usual),
  # unlike killing the process.
  marker = request.node.get_closest_marker('time_limit')
  seconds = marker.args[0] if marker else TEST_TIME_LIMIT_SECONDS

  def on_alarm(signum, frame):
    del signum, frame
    raise TestTimeLimitExceeded(f'{request.node.nodeid} ran over {seconds} s')

  previous = signal.signal(signal.SIGALRM, on_alarm)
  signal.alarm(seconds)
  yield
  signal.alarm(0)
  signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope='session', autouse=True)
def _private_temp_dir(tmp_path_factory):
  # Library code the tests run in-process leaves temp files behind (TFDS's
  # metadata lookup makes a /tmp/tmp*tfds directory per unprepared builder):
  # like the binaries, the session uses a temp directory removed at exit.
  # pytest's own directories stay in the shared one, for inspection.
  tmp_path_factory.getbasetemp()
  private_temp.use_private_temp_dir()
  yield


@pytest.fixture(scope='session', autouse=True)
def _stop_tff_workers_at_session_end():
  yield
  tff_runtime.shutdown_workers()


# Seconds each of the longest test files took in the suite (scripts/test.sh
# on 2 cores, 3 workers; rounded), for `--dist loadfile`'s order below. A
# file not listed counts as 0 s; the figures need only keep their order.
LONG_FILES_SECONDS = {
    'test_benchmark.py': 130, 'test_benchmark_modes.py': 120,
    'test_benchmark_floors.py': 90, 'test_aggregators.py': 225,
    'test_faults.py': 210, 'test_native_runtime.py': 180,
    'test_scaffold_cli.py': 165, 'test_scaffold_factored.py': 150,
    'test_first_run.py': 130, 'test_bad_inputs.py': 120, 'test_cli.py': 120,
    'test_fedres_factored.py': 105, 'test_driver.py': 95,
    'test_stackoverflow_runs.py': 90, 'test_multi_worker.py': 85,
    'test_mixed.py': 75, 'test_client_states.py': 70,
    'test_scaffold_non_finite.py': 60, 'test_movielens.py': 55,
    'test_fedres_pipeline.py': 55,
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadfile` handing out the longest files first.

  xdist orders files by their number of tests, which put files of a few long
  tests (test_scaffold_cli, test_first_run, test_driver) last: the suite
  ended with one worker busy on them. Longest first, the short files fill
  the workers' ends.
  """
  if config.getvalue('dist') != 'loadfile':
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=g-import-not-at-top

  class LongestFilesFirst(LoadFileScheduling):

    def _assign_work_unit(self, node):
      if not getattr(self, '_ordered', False):
        self._ordered = True
        order = sorted(self.workqueue, key=lambda scope: -LONG_FILES_SECONDS.get(
            os.path.basename(scope), 0))  # Stable: xdist's order otherwise.
        for scope in order:
          self.workqueue.move_to_end(scope)
      super()._assign_work_unit(node)

  return LongestFilesFirst(config, log)

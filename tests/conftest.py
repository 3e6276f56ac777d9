"""Test-session set-up: TFF's local runtime, and no worker left behind."""

import warnings

import pytest

from pipeline import tff_runtime


def pytest_configure(config):
  del config
  # TF/TFF dependencies warn about distutils at import; not ours to fix.
  warnings.filterwarnings('ignore', category=DeprecationWarning)
  tff_runtime.configure_execution()


@pytest.fixture(scope='session', autouse=True)
def _stop_tff_workers_at_session_end():
  yield
  tff_runtime.shutdown_workers()

"""Test-session set-up: TFF's local runtime, and no worker left behind."""

import pytest

from pipeline import tff_runtime


def pytest_configure(config):
  del config
  tff_runtime.configure_execution()


@pytest.fixture(scope='session', autouse=True)
def _stop_tff_workers_at_session_end():
  yield
  tff_runtime.shutdown_workers()

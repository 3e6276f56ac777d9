"""Runs one binary many times, each run a process of its own, from a process
that imported the binary (TensorFlow, TFF) once.

A binary spends ~10 s of CPU importing TensorFlow and TFF before it looks at
its flags; tests that run a binary on many bad inputs would spend most of
their time there. This server imports the binary, then forks a child per
request: the child is a fresh process in every way that matters (its own
flags, exit status, stdout/stderr, atexit hooks) without the import. The
server itself never runs TensorFlow, so the fork copies no running threads.

  python tests/preloaded_binary.py binaries.train

Requests are JSON lines on stdin: {"argv": [...], "stdout": path,
"stderr": path, "timeout": seconds or null}; each answer is two JSON lines,
{"pid": the child's pid} and, once it ended, {"status": exit status, or
-signal, "timed_out": whether the server killed it at the timeout}.
`PreloadedBinary` is the client.
"""

import atexit
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading


def _child(module, argv: list[str], stdout: str, stderr: str) -> None:
  """Runs the binary as `python -m <module> *argv` would; never returns."""
  for fd, path in ((1, stdout), (2, stderr)):
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
  sys.argv = [module.__file__, *argv]
  status = 0
  try:
    from binaries import app  # pylint: disable=g-import-not-at-top
    app.run(module.main)
  except SystemExit as e:
    status = e.code if isinstance(e.code, int) else (0 if e.code is None
                                                     else 1)
    if not isinstance(e.code, (int, type(None))):
      print(e.code, file=sys.stderr)
  except BaseException:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top
    traceback.print_exc()
    status = 1
  from binaries import app  # pylint: disable=g-import-not-at-top
  app.exit_without_finalizing(status)


def serve(module_name: str) -> None:
  module = importlib.import_module(module_name)
  print('ready', flush=True)
  for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      _child(module, request['argv'], request['stdout'], request['stderr'])
    print(json.dumps({'pid': pid}), flush=True)
    ended = threading.Event()
    timed_out = []

    def kill_at_timeout(pid=pid, ended=ended, timed_out=timed_out):
      if not ended.is_set():
        timed_out.append(True)
        os.kill(pid, signal.SIGKILL)

    timer = None
    if request.get('timeout') is not None:
      timer = threading.Timer(request['timeout'], kill_at_timeout)
      timer.start()
    # Not reaped before `ended` is set: the timer cannot kill another pid.
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    ended.set()
    if timer is not None:
      timer.cancel()
      timer.join()
    _, wait_status = os.waitpid(pid, 0)
    print(json.dumps({'status': os.waitstatus_to_exitcode(wait_status),
                      'timed_out': bool(timed_out)}), flush=True)
  # The execution context TFF made at import goes quietly, not in a
  # destructor at interpreter exit.
  from pipeline import tff_runtime  # pylint: disable=g-import-not-at-top
  tff_runtime.shutdown_workers()


class PreloadedBinary:
  """A running server of one binary (see module doc); one run at a time."""

  def __init__(self, module_name: str, cwd: str, env: dict):
    self.env = dict(env)
    self.broken = False
    self._lock = threading.Lock()
    self._server = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), module_name], cwd=cwd,
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = self._server.stdout.readline()
    if ready != 'ready\n':
      self.close()
      raise RuntimeError(f'{module_name} did not load: {ready!r}')

  def run(self, argv: list[str],
          timeout: float = None) -> subprocess.CompletedProcess:
    """Runs the binary with `argv` (stdin empty) and waits for it; after
    `timeout` seconds it is killed and `subprocess.TimeoutExpired` raised,
    as `subprocess.run` does."""
    with self._lock, tempfile.TemporaryDirectory() as directory:
      if self.broken:
        raise RuntimeError('this binary server stopped after an error')
      stdout = os.path.join(directory, 'stdout')
      stderr = os.path.join(directory, 'stderr')
      pid = None
      try:
        self._server.stdin.write(json.dumps(
            {'argv': [str(a) for a in argv], 'stdout': stdout,
             'stderr': stderr, 'timeout': timeout}) + '\n')
        self._server.stdin.flush()
        pid = json.loads(self._answer())['pid']
        answer = json.loads(self._answer())
      except BaseException:
        # E.g. the test's time limit, mid-run: the run's answer would be
        # read as the next one's. The run and the server go.
        self.broken = True
        if pid is not None:
          try:
            os.kill(pid, signal.SIGKILL)
          except ProcessLookupError:
            pass
        self._server.kill()
        raise
      with open(stdout) as out, open(stderr) as err:
        if answer['timed_out']:
          raise subprocess.TimeoutExpired(argv, timeout, out.read(),
                                          err.read())
        return subprocess.CompletedProcess(argv, answer['status'],
                                           out.read(), err.read())

  def _answer(self) -> str:
    answer = self._server.stdout.readline()
    if not answer:
      raise RuntimeError('the binary server died')
    return answer

  def close(self) -> None:
    if not self.broken:
      self._server.stdin.close()
    self._server.wait(timeout=60)
    self._server.stdout.close()


_shared = {}
_shared_lock = threading.Lock()


def shared(module_name: str, cwd: str, env: dict) -> PreloadedBinary:
  """This process's server of `module_name`, started on first use (and
  again after an error stopped it) and closed when the process exits."""
  with _shared_lock:
    if module_name not in _shared or _shared[module_name].broken:
      if not _shared:
        atexit.register(_close_shared)
      _shared[module_name] = PreloadedBinary(module_name, cwd, env)
    return _shared[module_name]


def _close_shared() -> None:
  for binary in _shared.values():
    binary.close()


if __name__ == '__main__':
  serve(sys.argv[1])

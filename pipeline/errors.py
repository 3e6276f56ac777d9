"""The exception types binaries turn into a single `error: ...` line.

UsageError ends a binary with exit status 2, EnvironmentFault with 3 (see
binaries/app.py, which also recognizes the OS's own disk-full and
write-permission errors as environment faults).
"""


import errno
import os
import re
import sys
from typing import Optional

# The OS's errors of an environment fault: a full disk or quota, a
# read-only or not permitted output.
ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                      errno.EPERM)

# What a client's state file whose values do not match its checksum raises
# (`tff_algos.runtime.client_states`), its path after it.
DAMAGED_CLIENT_STATE = ('client state file damaged or misplaced: its values '
                        'do not match its checksum')


class UsageError(Exception):
  """Bad user input: unknown names, impossible values, missing/corrupt files.

  The message names the flag or file and what is allowed; binaries print it as
  one line (no traceback) and exit non-zero before writing anything.
  """


class EnvironmentFault(Exception):
  """The machine, not the input: an output that cannot be written (disk
  full, read-only), or a TFF worker that cannot be started or reached.

  The message says what failed and how to recover; what was written before
  stays valid, so re-running the same command resumes.
  """


def first_line(text) -> str:
  """The gist of an error text: its first line, without TensorFlow's
  `{{function_node ...}}` prefix and `[Op:...]` suffix."""
  line = ' '.join(str(text).strip().splitlines()[:1])
  line = re.sub(r'\{\{[^}]*\}\}\s*', '', line)
  return re.sub(r'\s*\[Op:\w+\]( name: ?$)?', '', line)


def raise_if_unreadable(path: str) -> None:
  """Raises the OSError of a file or directory under `path` that this
  process may not read (e.g. Permission denied: an environment fault, status
  3). TF's loaders report it as any other failure, which read as a damaged
  checkpoint or export (and for a checkpoint, advice to delete it)."""
  import os  # pylint: disable=g-import-not-at-top

  def fail(error: OSError):
    raise error

  for directory, _, names in os.walk(path, onerror=fail):
    for name in names:
      with open(os.path.join(directory, name), 'rb'):
        pass


def not_a_directory(path: str) -> str:
  """Why `path`, which should be a directory, is not one (for messages)."""
  import os  # pylint: disable=g-import-not-at-top
  return 'is a file, not a directory' if os.path.exists(path) else (
      'does not exist')


# TFF's SqlClientData on a file without its tables, naming them as a Python
# frozenset.
_MISSING_TABLES = re.compile(r'does not have the required frozenset\(\{(.*)\}\) '
                             r'tables')


def load_failure(error: Exception) -> str:
  """Why a dataset loader failed, for messages: its message, or what an
  error without one means (TFF's loaders take the first client id with
  `next`, so a file of the right schema with none of the task's splits,
  e.g. another task's file, raises a bare StopIteration)."""
  missing = _MISSING_TABLES.search(str(error))
  if missing:
    tables = sorted(re.findall(r'\w+', missing.group(1)))
    return (f'it has no {" or ".join(tables)} table (a file of TFF\'s '
            'SqlClientData has tables examples and client_metadata)')
  if str(error):
    return str(error)
  if isinstance(error, StopIteration):
    return 'it holds no clients of the task\'s splits (another dataset\'s file?)'
  return type(error).__name__


def load_error(dataset: str, path: str, error: Exception) -> Exception:
  """What to raise for a dataset loader's failure on `path`: an
  EnvironmentFault if it could not download (--download without a network:
  re-running once it is back goes on), else a UsageError (the file)."""
  reason = download_failure(error)
  if reason is not None:
    return EnvironmentFault(
        f'cannot download {dataset} into {path}: {reason}; check the '
        'network (or put the file there yourself) and re-run the same '
        'command')
  return UsageError(f'cannot read {dataset} from {path}: {load_failure(error)}')


def download_failure(error: BaseException) -> Optional[str]:
  """Why `error` (or an error it was raised from) is a failed download -
  no network, name resolution, a refused or timed-out connection - or None.

  urllib (TFF's loaders) raises a URLError; requests and urllib3 (TFDS's
  downloads) raise their own errors from the socket's, whose message is the
  useful part.
  """
  import socket  # pylint: disable=g-import-not-at-top
  import urllib.error  # pylint: disable=g-import-not-at-top
  link = error
  while link is not None:
    if isinstance(link, urllib.error.URLError):
      return str(link.reason)
    if isinstance(link, (socket.gaierror, ConnectionError, TimeoutError)):
      return str(link)
    link = link.__cause__ or link.__context__
  return None


def check_host_resolves(url: str) -> None:
  """Raises the socket's error at once when `url`'s host has no address.

  Without a network a download by requests (TFDS's) is retried for minutes
  (TFDS: 10 retries, 3.5 minutes here) before it fails; a name that does not
  resolve will not resolve on the tenth try either. Behind a proxy, which
  resolves names itself, nothing is checked.
  """
  import socket  # pylint: disable=g-import-not-at-top
  import urllib.parse  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  if urllib.request.getproxies():
    return
  parts = urllib.parse.urlsplit(url)
  socket.getaddrinfo(parts.hostname, parts.port or parts.scheme)


def refuse_to_run_library_module(spec) -> None:
  """Ends `python -m <a library module>` (which would do nothing and exit 0)
  with one line naming the package's programs, status 2."""
  directory = os.path.dirname(spec.origin)
  package = spec.name.rsplit('.', 1)[0]
  programs = []
  for name in sorted(os.listdir(directory)):
    if name.endswith('.py') and name != '__init__.py':
      with open(os.path.join(directory, name), encoding='utf-8') as f:
        text = f.read()
      if ("__name__ == '__main__'" in text and
          'refuse_to_run_library_module' not in text):
        programs.append(f'{package}.{name[:-3]}')
  print(f'error: {spec.name} is a library module, not a program (run one of: '
        f'{", ".join(programs)})', file=sys.stderr)
  sys.exit(2)

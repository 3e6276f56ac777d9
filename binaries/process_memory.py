"""Resident memory and CPU time of a measured process and of its TFF worker
processes."""


def rss_mb(process) -> tuple[float, float]:
  """RSS in MB of `process` and of all its descendants (TFF's workers).

  Processes that end while being read count 0.
  """
  import psutil  # pylint: disable=g-import-not-at-top
  try:
    children = process.children(recursive=True)
  except psutil.Error:
    return 0.0, 0.0
  totals = []
  for processes in ([process], children):
    total = 0
    for p in processes:
      try:
        total += p.memory_info().rss
      except psutil.Error:
        continue
    totals.append(total / 2**20)
  return totals[0], totals[1]


def cpu_seconds(process) -> float:
  """User plus system CPU seconds of `process` and of its live descendants
  (TFF's workers), so far.

  A descendant that has ended no longer counts: TFF's workers live as long
  as the run.
  """
  import psutil  # pylint: disable=g-import-not-at-top
  total = 0.0
  try:
    processes = [process] + process.children(recursive=True)
  except psutil.Error:
    return total
  for p in processes:
    try:
      times = p.cpu_times()
    except psutil.Error:
      continue
    total += times.user + times.system
  return total


if __name__ == '__main__':
  from pipeline import errors as _errors  # pylint: disable=g-import-not-at-top
  _errors.refuse_to_run_library_module(__spec__)

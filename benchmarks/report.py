"""Lines of the round benchmark's summary that are pure arithmetic on its
measurements (no flags, no TensorFlow: tests call them in-process)."""

from typing import Callable, Optional


def _extra_work_lines(by_key: dict, base_algorithm: str,
                      extra_seconds: Callable[[str, int], Optional[float]],
                      what: str) -> list[str]:
  """Each algorithm's round (tff, native) as x times `base_algorithm`'s
  round on the same clients plus the algorithm's extra work, when
  `extra_seconds(algorithm, clients)` knows that work."""
  lines = []
  for algorithm, clients in sorted({(a, c) for a, _, c in by_key}):
    extra = extra_seconds(algorithm, clients)
    if extra is None:
      continue
    for runtime in ('tff', 'native'):
      record = by_key.get((algorithm, runtime, clients))
      base = by_key.get((base_algorithm, runtime, clients))
      if record is None or base is None:
        continue
      seconds, base_s = record['seconds_per_round'], base['seconds_per_round']
      lines.append(
          f'  {algorithm}, {runtime}, {clients} clients: round {seconds:.3f} s'
          f' = x{(seconds - extra) / base_s:.2f} FedAvg\'s {base_s:.3f} s + '
          f'{what} {extra:.3f} s')
  return lines


def central_work_lines(by_key: dict, base_algorithm: str) -> list[str]:
  """Per mixed FL round measured with its central work alone (mode
  central): its round as x times the round of `base_algorithm` (FedAvg on
  the same clients) plus that work."""

  def central_seconds(algorithm, clients):
    central = by_key.get((algorithm, 'central', clients))
    return central and central['seconds_per_round']

  return _extra_work_lines(by_key, base_algorithm, central_seconds,
                           'its central work alone')


def bound_extra_work_lines(by_key: dict) -> list[str]:
  """Per stateful algorithm with a plain-TF bound (mode bound): its round as
  x times FedAvg's plus its extra work, the difference of the two bounds
  (control variates, personal models, their state files)."""

  def extra_seconds(algorithm, clients):
    bound = by_key.get((algorithm, 'bound', clients))
    fedavg = by_key.get(('fedavg', 'bound', clients))
    if algorithm == 'fedavg' or bound is None or fedavg is None:
      return None
    return bound['seconds_per_round'] - fedavg['seconds_per_round']

  return _extra_work_lines(by_key, 'fedavg', extra_seconds,
                           'its extra work in plain TF ((c) minus FedAvg\'s)')


if __name__ == '__main__':
  from pipeline import errors as _errors  # pylint: disable=g-import-not-at-top
  _errors.refuse_to_run_library_module(__spec__)

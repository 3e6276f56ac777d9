"""Lines of the round benchmark's summary that are pure arithmetic on its
measurements (no flags, no TensorFlow: tests call them in-process)."""


def central_work_lines(by_key: dict, base_algorithm: str) -> list[str]:
  """Per mixed FL round measured with its central work alone (mode
  central): its round as x times the round of `base_algorithm` (FedAvg on
  the same clients) plus that work."""
  lines = []
  for (algorithm, mode, clients), central in sorted(by_key.items()):
    if mode != 'central':
      continue
    for runtime in ('tff', 'native'):
      record = by_key.get((algorithm, runtime, clients))
      fedavg = by_key.get((base_algorithm, runtime, clients))
      if record is None or fedavg is None:
        continue
      seconds, fedavg_s, central_s = (
          r['seconds_per_round'] for r in (record, fedavg, central))
      lines.append(
          f'  {algorithm}, {runtime}, {clients} clients: round {seconds:.3f} s'
          f' = x{(seconds - central_s) / fedavg_s:.2f} FedAvg\'s '
          f'{fedavg_s:.3f} s + its central work alone {central_s:.3f} s')
  return lines

"""This project's FedAvg and SCAFFOLD rounds against pfl-research's, alternating.

Run from the repository root with the project's Python, after
benchmarks/peers/setup_pfl_venv.sh:

  .venv/bin/python -m benchmarks.peers.compare --pairs=5   # the published run
  .venv/bin/python -m benchmarks.peers.compare --pairs=1 \\
      --clients_per_round=10 --rounds=1                      # does it run

Each pair is A then B, so both sides see the same minutes of the machine:
  A: this project's benchmark, one driver mode (--project_mode: native,
     the in-process runtime, by default; tff: TFF's runtime):
     `.venv/bin/python -m benchmarks.rounds --modes=native` measuring FedAvg
     and, in its sweep, SCAFFOLD (c_i in the driver's on-disk store);
  B: pfl_benchmark.py in the peer venv, once per pfl configuration
     (--pfl_configs: processes x torch threads [+ DataLoader processes])
     for FedAvg and for SCAFFOLD with pfl's c_i storage on disk and in
     memory (in-memory only with one process: pfl keeps it per process).
Both sides run the same workload (pfl_benchmark.py's docstring) and the
same timed and warm-up rounds; each measurement is its own process (tree),
timed per round, its median taken. The table gives, per algorithm, the
median over the pairs of each side's seconds per round, pfl's best
configuration (lowest median), the median over the pairs of the per-pair
ratio pfl / project, and each side's largest peak RSS (the measured process
and all its children).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from binaries import app

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PFL_RESULT_PREFIX = 'PFL_RESULT '
# benchmarks.rounds's line per measurement (benchmark.format_measurement).
PROJECT_LINE = re.compile(
    r'^\s*(?P<mode>tff|native|naive|bound)\s+(?P<algorithm>\S+)\s+(?P<clients>\d+) '
    r'clients:\s+(?P<seconds>[\d.]+) s/round \(rounds: (?P<rounds>[^)]*)\), '
    r'peak RSS\s+(?P<rss>\d+) MB')
CONFIG = re.compile(r'^(\d+)x(\d+)(?:\+(\d+))?$')
SCAFFOLD_STORES = ('disk', 'memory')


def parse_project_output(text: str, mode: str = 'tff') -> list[dict]:
  """The measurements of one (a) mode in benchmarks.rounds's output."""
  records = []
  for line in text.splitlines():
    match = PROJECT_LINE.match(line)
    if not match or match['mode'] != mode:
      continue
    records.append(dict(
        side='project', algorithm=match['algorithm'],
        clients=int(match['clients']),
        seconds_per_round=float(match['seconds']),
        round_seconds=[float(s) for s in match['rounds'].split(', ')],
        peak_rss_mb=float(match['rss'])))
  return records


def parse_pfl_output(text: str) -> dict:
  """pfl_benchmark.py's result line as a record."""
  lines = [l for l in text.splitlines() if l.startswith(PFL_RESULT_PREFIX)]
  if not lines:
    raise ValueError('no ' + PFL_RESULT_PREFIX.strip() + ' line')
  result = json.loads(lines[-1][len(PFL_RESULT_PREFIX):])
  return dict(side='pfl', algorithm=result['algorithm'],
              state_store=result.get('state_store'),
              config=config_name(result['processes'], result['threads'],
                                 result.get('loader_workers', 0)),
              clients=result['clients'],
              seconds_per_round=result['seconds_per_round'],
              round_seconds=result['round_seconds'],
              peak_rss_mb=float(result['peak_rss_mb']))


def config_name(processes: int, threads: int, loader_workers: int) -> str:
  return f'{processes}x{threads}' + (f'+{loader_workers}' if loader_workers
                                     else '')


def parse_configs(text: str) -> list[tuple[int, int, int]]:
  """'PxT[+L]' items: P pfl processes x T torch threads each [+ L
  DataLoader processes each making users' data ahead]."""
  configs = []
  for item in text.split(','):
    match = CONFIG.match(item.strip())
    if not match or min(int(match[1]), int(match[2])) < 1:
      raise ValueError(f'--pfl_configs item {item!r} is not '
                       'PROCESSESxTHREADS[+LOADERS] (e.g. 2x1, 1x1+1)')
    configs.append((int(match[1]), int(match[2]), int(match[3] or 0)))
  return configs


def pfl_variants(algorithms: list[str], stores: list[str]
                 ) -> list[tuple[str, str]]:
  """(row name, pfl algorithm) pairs: FedAvg, SCAFFOLD per c_i storage."""
  variants = []
  for algorithm in algorithms:
    if algorithm == 'scaffold':
      variants += [(f'scaffold, pfl c_i {store}', store) for store in stores]
    else:
      variants.append((algorithm, None))
  return variants


def row_name(record: dict) -> str:
  if record['algorithm'] == 'scaffold':
    return f'scaffold, pfl c_i {record["state_store"]}'
  return record['algorithm']


def summarize(pairs: list[dict]) -> list[dict]:
  """Per pfl row: both sides' medians, pfl's best config, ratio, peak RSS.

  `pairs` holds per pair {'project': [records], 'pfl': [records]}.
  """
  rows = {}
  for pair in pairs:
    project = {r['algorithm']: r for r in pair['project']}
    for record in pair['pfl']:
      row = rows.setdefault(row_name(record), dict(
          name=row_name(record), algorithm=record['algorithm'], configs={}))
      row['configs'].setdefault(record['config'], []).append(
          (record, project.get(record['algorithm'])))
  out = []
  for row in rows.values():
    config_medians = {
        config: statistics.median(r['seconds_per_round'] for r, _ in runs)
        for config, runs in row['configs'].items()}
    best = min(config_medians, key=config_medians.get)
    runs = [(r, p) for r, p in row['configs'][best] if p is not None]
    project_runs = [p for pair in pairs for p in pair['project']
                    if p['algorithm'] == row['algorithm']]
    pfl_runs = [r for config_runs in row['configs'].values()
                for r, _ in config_runs]
    out.append(dict(
        name=row['name'], best_config=best,
        pfl_seconds=config_medians[best],
        project_seconds=(statistics.median(
            p['seconds_per_round'] for p in project_runs)
                         if project_runs else None),
        ratio=(statistics.median(r['seconds_per_round'] /
                                 p['seconds_per_round'] for r, p in runs)
               if runs else None),
        pairs=len(runs),
        pfl_peak_rss_mb=max(r['peak_rss_mb'] for r, _ in
                            row['configs'][best]),
        project_peak_rss_mb=(max(p['peak_rss_mb'] for p in project_runs)
                             if project_runs else None),
        configs={config: dict(
            seconds=config_medians[config],
            peak_rss_mb=max(r['peak_rss_mb'] for r, _ in runs_))
                 for config, runs_ in row['configs'].items()}))
  return out


def _cell(value, fmt):
  return '-' if value is None else format(value, fmt)


def format_table(rows: list[dict], clients: int) -> str:
  lines = [
      f'| {clients} clients per round | this project s/round | pfl s/round '
      '(best config) | ratio pfl/project | peak RSS project | peak RSS pfl |',
      '|---|---|---|---|---|---|']
  for row in rows:
    lines.append(
        f'| {row["name"]} | {_cell(row["project_seconds"], ".3f")} | '
        f'{row["pfl_seconds"]:.3f} ({row["best_config"]}) | '
        f'{_cell(row["ratio"], ".2f")} | '
        f'{_cell(row["project_peak_rss_mb"], ".0f")} MB | '
        f'{row["pfl_peak_rss_mb"]:.0f} MB |')
  lines += ['', '| pfl configuration (processes x threads [+ loaders]) | ' + ' | '.join(
      row['name'] for row in rows) + ' |',
            '|---' * (len(rows) + 1) + '|']
  configs = sorted({c for row in rows for c in row['configs']})
  for config in configs:
    cells = []
    for row in rows:
      entry = row['configs'].get(config)
      cells.append('-' if entry is None else
                   f'{entry["seconds"]:.3f} s ({entry["peak_rss_mb"]:.0f} MB)')
    lines.append(f'| {config} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


# ------------------------------------------------------------------ running --


def _run(command: list[str], what: str) -> str:
  result = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  if result.returncode:
    sys.stderr.write(result.stderr[-4000:])
    raise SystemExit(f'error: {what} failed (exit {result.returncode}): '
                     + ' '.join(command))
  return result.stdout


def run_project(args, algorithms: list[str]) -> list[dict]:
  sweep = [a for a in algorithms if a != 'fedavg']
  command = [args.project_python, '-m', 'benchmarks.rounds',
             f'--modes={args.project_mode}',
             f'--clients_per_round={args.clients_per_round}',
             f'--population={args.population}', f'--rounds={args.rounds}',
             f'--warmup_rounds={args.warmup_rounds}',
             f'--client_steps={args.client_steps}',
             f'--client_batch_size={args.client_batch_size}',
             '--sweep_clients=' + (str(args.clients_per_round) if sweep
                                   else ''),
             '--sweep_algorithms=' + ','.join(sweep)] + args.project_args
  records = parse_project_output(_run(command, 'the project benchmark'),
                                 args.project_mode)
  for record in records:
    print(f'  project {record["algorithm"]:28s}      '
          f'{record["seconds_per_round"]:7.3f} s/round, peak RSS '
          f'{record["peak_rss_mb"]:.0f} MB', flush=True)
  return records


def run_pfl(args, algorithm: str, store: str, processes: int, threads: int,
            loader_workers: int) -> dict:
  command = [args.pfl_python, os.path.join(HERE, 'pfl_benchmark.py'),
             f'--algorithm={algorithm}',
             f'--clients_per_round={args.clients_per_round}',
             f'--population={args.population}', f'--rounds={args.rounds}',
             f'--warmup_rounds={args.warmup_rounds}',
             f'--client_steps={args.client_steps}',
             f'--client_batch_size={args.client_batch_size}',
             f'--processes={processes}', f'--threads={threads}',
             f'--loader_workers={loader_workers}']
  if store:
    command.append(f'--state_store={store}')
  record = parse_pfl_output(_run(command, 'pfl_benchmark.py'))
  print(f'  pfl     {row_name(record):28s} {record["config"]:>6s} '
        f'{record["seconds_per_round"]:7.3f} s/round, peak RSS '
        f'{record["peak_rss_mb"]:.0f} MB', flush=True)
  return record


def parse_args(argv):
  parser = app.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--pairs', type=int, default=5,
                      help='A B pairs (project, pfl) to run.')
  parser.add_argument('--algorithms', default='fedavg,scaffold')
  parser.add_argument('--scaffold_stores', default='disk,memory',
                      help="pfl's SCAFFOLD c_i storage(s) to measure.")
  parser.add_argument('--pfl_configs', default='1x1,1x2,2x1,1x1+1',
                      help='pfl configurations to try, PROCESSESxTHREADS'
                      '[+LOADERS] (pfl processes x torch threads each, + '
                      'DataLoader processes each); the table shows the '
                      'fastest.')
  parser.add_argument('--clients_per_round', type=int, default=100)
  parser.add_argument('--population', type=int, default=2000)
  parser.add_argument('--rounds', type=int, default=4,
                      help='Timed rounds per measurement.')
  parser.add_argument('--warmup_rounds', type=int, default=1)
  parser.add_argument('--client_steps', type=int, default=2)
  parser.add_argument('--client_batch_size', type=int, default=5)
  parser.add_argument('--project_python',
                      default=os.path.join(REPO, '.venv', 'bin', 'python'))
  parser.add_argument('--pfl_python',
                      default=os.path.join(REPO, '.peers-venv', 'bin',
                                           'python'))
  parser.add_argument('--project_mode', default='native',
                      choices=('tff', 'native'),
                      help="The project's runtime: TFF's or the native one "
                      '(benchmarks.rounds mode).')
  parser.add_argument('--project_args', default='',
                      help='Extra flags for benchmarks.rounds, e.g. '
                      '"--num_workers=2".')
  parser.add_argument('--output_json', default=None,
                      help='Also write every measurement here.')
  args = parser.parse_args(argv)
  args.project_args = args.project_args.split()
  args.algorithms = [a for a in args.algorithms.split(',') if a]
  args.scaffold_stores = [s for s in args.scaffold_stores.split(',') if s]
  try:
    args.pfl_configs = parse_configs(args.pfl_configs)
  except ValueError as e:
    parser.error(str(e))
  if not args.algorithms or set(args.algorithms) - {'fedavg', 'scaffold'}:
    parser.error('--algorithms must name fedavg and/or scaffold')
  if set(args.scaffold_stores) - set(SCAFFOLD_STORES) or (
      'scaffold' in args.algorithms and not args.scaffold_stores):
    parser.error('--scaffold_stores must name disk and/or memory')
  if args.pairs < 1 or args.rounds < 1 or args.warmup_rounds < 1:
    parser.error('--pairs, --rounds and --warmup_rounds must be >= 1')
  for processes, _, _ in args.pfl_configs:
    if args.clients_per_round % processes:
      parser.error(f'--clients_per_round={args.clients_per_round} is not a '
                   f'multiple of {processes} pfl processes')
  for name in ('project_python', 'pfl_python'):
    if not os.access(getattr(args, name), os.X_OK):
      hint = (' (run benchmarks/peers/setup_pfl_venv.sh)'
              if name == 'pfl_python' else '')
      parser.error(f'--{name}={getattr(args, name)} is not executable{hint}')
  return args


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  print(f'peers: {args.pairs} pair(s), {args.clients_per_round} of '
        f'{args.population} clients per round, K={args.client_steps}, '
        f'B={args.client_batch_size}, {args.rounds} timed + '
        f'{args.warmup_rounds} warm-up rounds, {os.cpu_count()} CPUs, load '
        f'average {", ".join(f"{x:.2f}" for x in os.getloadavg())}',
        flush=True)
  pairs = []
  started = time.perf_counter()
  for pair_num in range(1, args.pairs + 1):
    print(f'pair {pair_num}/{args.pairs}', flush=True)
    pair = dict(project=run_project(args, args.algorithms), pfl=[])
    for _, store in pfl_variants(args.algorithms, args.scaffold_stores):
      algorithm = 'scaffold' if store else 'fedavg'
      for processes, threads, loader_workers in args.pfl_configs:
        if store == 'memory' and processes > 1:
          continue  # pfl's in-memory user state is per process.
        pair['pfl'].append(run_pfl(args, algorithm, store, processes,
                                   threads, loader_workers))
    pairs.append(pair)
  rows = summarize(pairs)
  print(f'\n{args.pairs} pair(s) in {time.perf_counter() - started:.0f} s; '
        f'load average at the end '
        f'{", ".join(f"{x:.2f}" for x in os.getloadavg())}\n')
  print(format_table(rows, args.clients_per_round))
  if args.output_json:
    with open(args.output_json, 'w') as f:
      json.dump(dict(pairs=pairs, rows=rows), f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())

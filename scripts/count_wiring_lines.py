"""Counts the wiring that spelled each round twice against its new form.

  .venv/bin/python scripts/count_wiring_lines.py [--old=1a7cc7d] [--new=HEAD]

Before (`--old`, default 1a7cc7d: the last commit before the redesign), each
algorithm was a TFF process (`tff_algos/*_tff.py`, `baselines.py`) and again
a native loop (`*_native.py`, with `native.py`'s executor). After (`--new`),
each algorithm declares its round once (`algorithms/<family>/definition.py`,
on the types of `algorithms/round.py`) and two generic interpreters run it
(`runtime/tff_process.py`, `runtime/native.py`). Files are read from git
(`git show <commit>:<path>`; `--new=.` reads the working tree), so the
figures are those of the commits named.

Two counts per file: total lines, and code lines (lines with a Python token
that is not a comment, a docstring or blank). Units that are not round
wiring are left out of both sides, found by name in the syntax tree, and
counted apart:
- settings: the new typed settings dataclasses; they replace the old
  modules' flag lists and `_validate` functions (left out of the old side)
  and also `config.AlgorithmConfig` and the flag definitions of
  `binaries/flags_lib.py`, which were never counted;
- client math: FedAvg's and FedSGD's client updates written as steps (the
  old modules ran tff.learning's; the other families' client math is in
  their `math.py`, as it was in `*_tf.py`, counted on neither side);
- features of other issues merged meanwhile: pluggable model aggregators
  (DP, compression, secure sum: `--aggregator`) in the TFF builder, and
  batched cohorts (`--batched_cohorts`) in the native executor. These are
  lines, not units: the physical lines that name one of the feature's
  values (`FEATURE_NAMES`), the bodies of `if` statements that test one,
  and functions named by one.
The server's part of a round that both runtimes share
(`runtime/server.py`) is counted on the new side.
A second table adds what turns the old dataset-level processes into the
by-id processes the driver runs (`contract.py`, `dataset_fusion.py`) against
its new form (`runtime/cohort.py`, which also runs the client work's steps
over each group's batches).
"""

import argparse
import ast
import dataclasses
import io
import os
import subprocess
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_FILES = ('tff_algos/baselines.py', 'tff_algos/baselines_native.py',
             'tff_algos/fedres_native.py', 'tff_algos/fedres_tff.py',
             'tff_algos/mixed_native.py', 'tff_algos/mixed_tff.py',
             'tff_algos/native.py', 'tff_algos/scaffold_native.py',
             'tff_algos/scaffold_tff.py')
NEW_FILES = ('tff_algos/algorithms/round.py',
             'tff_algos/algorithms/baselines/definition.py',
             'tff_algos/algorithms/fedres/definition.py',
             'tff_algos/algorithms/mixed/definition.py',
             'tff_algos/algorithms/scaffold/definition.py',
             'tff_algos/runtime/tff_process.py',
             'tff_algos/runtime/native.py',
             'tff_algos/runtime/server.py')
OLD_BY_ID = ('tff_algos/contract.py', 'tff_algos/dataset_fusion.py')
NEW_BY_ID = ('tff_algos/runtime/cohort.py',)

SETTINGS = 'settings'
CLIENT_MATH = 'client math'
OTHER_ISSUES = 'other issues'


def _old_unit(path: str, node: ast.AST) -> str:
  """The category of a top-level unit of an old file ('' = wiring)."""
  del path
  names = []
  if isinstance(node, (ast.Assign, ast.AnnAssign)):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = [t.id for t in targets if isinstance(t, ast.Name)]
  elif isinstance(node, ast.FunctionDef):
    names = [node.name]
  if any(n.endswith('FLAGS') or n == 'FLAG_NAMES' or n == '_validate'
         for n in names):
    return SETTINGS
  return ''


def _new_unit(path: str, node: ast.AST) -> str:
  """The category of a top-level unit of a new file ('' = wiring)."""
  if isinstance(node, ast.ClassDef) and node.name.endswith('Settings'):
    return SETTINGS
  if isinstance(node, ast.Assign) and any(
      isinstance(t, ast.Name) and t.id == 'SETTINGS' for t in node.targets):
    return SETTINGS
  if path.endswith('baselines/definition.py') and isinstance(
      node, ast.FunctionDef) and node.name in ('model_delta_work',
                                               'fed_sgd_work'):
    return CLIENT_MATH
  return ''


# Lines of a new file that serve one feature of another issue only: physical
# lines that name one of these values, the bodies of `if` statements whose
# test names one, and functions named by one (`_feature_lines`).
FEATURE_NAMES = {
    # `--batched_cohorts` in the native executor.
    'tff_algos/runtime/native.py': ('batched', 'side_by_side',
                                    'batched_cohorts'),
    # `--aggregator` (TFF's aggregators for the model update) in the TFF
    # builder: the factory, its process, its state in the server state.
    'tff_algos/runtime/tff_process.py': (
        'model_aggregator', 'aggregation', 'weighted', 'algorithm_part',
        'algorithm_state_of', '_with_aggregator'),
}


@dataclasses.dataclass
class Count:
  code: int = 0
  total: int = 0

  def add(self, other: 'Count') -> None:
    self.code += other.code
    self.total += other.total


def _docstring_lines(tree: ast.AST) -> set[int]:
  lines = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                         ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(
          body[0].value, ast.Constant) and isinstance(body[0].value.value,
                                                      str):
        lines.update(range(body[0].lineno, body[0].end_lineno + 1))
  return lines


def _code_lines(source: str) -> set[int]:
  lines = set()
  skipped = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
             tokenize.DEDENT, tokenize.ENDMARKER)
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type not in skipped:
      lines.update(range(token.start[0], token.end[0] + 1))
  return lines - _docstring_lines(ast.parse(source))


def _span(node: ast.AST) -> set[int]:
  first = min([node.lineno] + [d.lineno for d in
                               getattr(node, 'decorator_list', [])])
  return set(range(first, node.end_lineno + 1))


def _names_in(node: ast.AST) -> set[str]:
  return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
          if isinstance(n, (ast.Name, ast.Attribute))} | {
              n.arg for n in ast.walk(node) if isinstance(n, ast.arg)}


def _feature_lines(tree: ast.AST, source: str, names) -> set[int]:
  """Lines that serve only the feature whose values are `names`."""
  names = set(names)
  lines = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and names & _names_in(node.test):
      lines.update(range(node.lineno, node.test.end_lineno + 1))
      lines.update(*(_span(s) for s in node.body))
    elif isinstance(node, ast.FunctionDef) and node.name in names:
      lines.update(_span(node))
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.NAME and token.string in names:
      lines.add(token.start[0])
  return lines


def count_file(source: str, path: str, classify) -> dict[str, Count]:
  """Counts of `source` by category ('' = wiring)."""
  tree = ast.parse(source)
  code = _code_lines(source)
  category_of_line = {}
  for node in tree.body:
    category = classify(path, node)
    if category:
      for line in _span(node):
        category_of_line[line] = category
  if classify is _new_unit and path in FEATURE_NAMES:
    for line in _feature_lines(tree, source, FEATURE_NAMES[path]):
      category_of_line.setdefault(line, OTHER_ISSUES)
  counts = {}
  for line in range(1, len(source.splitlines()) + 1):
    count = counts.setdefault(category_of_line.get(line, ''), Count())
    count.total += 1
    count.code += line in code
  return counts


def _show(commit: str, path: str) -> str:
  if commit == '.':
    with open(os.path.join(ROOT, path), encoding='utf-8') as f:
      return f.read()
  shown = subprocess.run(['git', 'show', f'{commit}:{path}'], cwd=ROOT,
                         capture_output=True, text=True)
  if shown.returncode:
    # Was a CalledProcessError traceback (e.g. outside a git checkout).
    problem = (shown.stderr.strip().splitlines() or ['git failed'])[-1]
    print(f'error: cannot read {path} at {commit} (needs a git checkout '
          f'that has it; --new=. reads the working tree): {problem}',
          file=sys.stderr)
    sys.exit(2)
  return shown.stdout


def count_side(commit: str, paths, classify, verbose: bool
               ) -> dict[str, Count]:
  totals = {}
  for path in paths:
    counts = count_file(_show(commit, path), path, classify)
    for category, count in counts.items():
      totals.setdefault(category, Count()).add(count)
    if verbose:
      wiring = counts.get('', Count())
      others = ', '.join(f'{c}: {n.code}/{n.total}'
                         for c, n in sorted(counts.items()) if c)
      print(f'  {commit}:{path}: {wiring.code} code / {wiring.total} total'
            + (f' (left out: {others})' if others else ''))
  return totals


def _reduction(old: int, new: int) -> str:
  return f'{100.0 * (old - new) / old:.1f}% shorter'


def report(title: str, old: dict[str, Count], new: dict[str, Count]) -> None:
  print(f'\n{title}')
  print(f'{"":32s}{"code":>8s}{"total":>8s}')
  rows = [('old wiring', old.get('', Count())),
          ('new wiring', new.get('', Count()))]
  for label, count in rows:
    print(f'{label:32s}{count.code:8d}{count.total:8d}')
  o, n = rows[0][1], rows[1][1]
  print(f'{"reduction":32s}{_reduction(o.code, n.code):>8s}  (code), '
        f'{_reduction(o.total, n.total)} (total)')
  for side, counts in (('old', old), ('new', new)):
    for category in (SETTINGS, CLIENT_MATH, OTHER_ISSUES):
      if category in counts:
        count = counts[category]
        print(f'  left out, {side} {category:14s}{count.code:8d}'
              f'{count.total:8d}')
  strict_old = sum(c.code for c in old.values())
  strict_new = sum(c.code for c in new.values())
  print(f'{"everything counted (code)":32s}{strict_old:8d} -> {strict_new}: '
        f'{_reduction(strict_old, strict_new)}')


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--old', default='1a7cc7d')
  parser.add_argument('--new', default='HEAD',
                      help="a commit, or '.' for the working tree")
  parser.add_argument('--quiet', action='store_true', help='no per-file rows')
  args = parser.parse_args()
  verbose = not args.quiet
  if verbose:
    print('per file (wiring code / total):')
  old = count_side(args.old, OLD_FILES, _old_unit, verbose)
  new = count_side(args.new, NEW_FILES, _new_unit, verbose)
  report(f'round wiring, {args.old} -> {args.new}', old, new)
  old_by_id = count_side(args.old, OLD_BY_ID, _old_unit, verbose)
  new_by_id = count_side(args.new, NEW_BY_ID, _new_unit, verbose)
  for total, part in ((old, old_by_id), (new, new_by_id)):
    for category, count in part.items():
      total.setdefault(category, Count()).add(count)
  report('with the by-id composition (contract.py, dataset_fusion.py -> '
         'runtime/cohort.py)', old, new)
  return 0


if __name__ == '__main__':
  sys.exit(main())

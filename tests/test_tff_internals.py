"""Every use of TFF's non-public parts is in tff_algos/tff_internals.py.

Reads the project's sources (not the tests, which check those internals
against TFF's own code) and finds, outside tff_internals.py:
- imports of `tensorflow_federated.python` / `.proto` modules (also as a
  module-path string, e.g. for importlib);
- private attributes (`x._name`, `getattr(x, '_name')`) of a TFF module or
  of any object when `_name` is a private name TFF's own sources define
  (`self._name = ...`, `def _name`, `_name = ...`), except on `self`/`cls`
  and namedtuple methods.
No TensorFlow is imported: the files are parsed.
"""

import ast
import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIRS = ('tff_algos', 'pipeline', 'binaries', 'benchmarks', 'tasks',
               'experiments', 'scripts')
INTERNALS = os.path.join('tff_algos', 'tff_internals.py')
PRIVATE_MODULE = re.compile(r'^tensorflow_federated\.(python|proto)(\.\w+)*$')
NAMEDTUPLE_METHODS = {'_replace', '_asdict', '_fields', '_make',
                      '_field_defaults'}
ACCESSORS = {'getattr', 'setattr', 'hasattr', 'delattr'}
# (file, name): private attributes with a name TFF also defines, of objects
# that are not TFF's.
NOT_TFF = {
    # Keras's MeanMetricWrapper._fn.
    ('tff_algos/runtime/batched.py', '_fn'): 'a Keras metric',
}
# Uses on TFF objects still outside tff_internals (tff_internals has the
# accessor to use instead). Remove an entry when its use moves.
PENDING = {
    ('tff_algos/runtime/batched.py', '_keras_model'):
        'tff_internals.keras_model_of(model)',
    ('tff_algos/runtime/batched.py', '_loss_fns'):
        'tff_internals.keras_losses_of(model)',
}


def _tff_private_names() -> set[str]:
  spec = importlib.util.find_spec('tensorflow_federated')
  root = os.path.dirname(spec.origin)
  pattern = re.compile(
      r'self\.(_[A-Za-z]\w*)\s*[:=]|^\s*(?:async\s+)?(?:def|class)\s+'
      r'(_[A-Za-z]\w*)|^(_[A-Za-z]\w*)\s*[:=]', re.M)
  names = set()
  for folder, _, files in os.walk(root):
    for name in files:
      if name.endswith('.py') and not name.endswith('_test.py'):
        with open(os.path.join(folder, name), encoding='utf-8') as f:
          names.update(next(g for g in m.groups() if g)
                       for m in pattern.finditer(f.read()))
  return names - NAMEDTUPLE_METHODS


def _sources() -> list[str]:
  found = []
  for top in SOURCE_DIRS:
    for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
      dirs[:] = [d for d in dirs if not d.startswith('.')]
      found += [os.path.relpath(os.path.join(folder, f), ROOT)
                for f in files if f.endswith('.py')]
  return sorted(path for path in found if path != INTERNALS)


def _root_name(node):
  while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
    node = node.func if isinstance(node, ast.Call) else node.value
  return node.id if isinstance(node, ast.Name) else None


def _uses(path: str, tff_private: set[str],
          root: str = ROOT) -> list[tuple[int, str, str]]:
  """(line, name, what) of each use of a TFF internal in `path`."""
  with open(os.path.join(root, path), encoding='utf-8') as f:
    tree = ast.parse(f.read(), path)
  tff_names = set()  # Names bound to TFF modules or objects in this file.
  uses = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split('.')[0] == 'tensorflow_federated':
          tff_names.add((alias.asname or alias.name).split('.')[0])
        if PRIVATE_MODULE.match(alias.name):
          uses.append((node.lineno, alias.name, 'import'))
    elif isinstance(node, ast.ImportFrom) and node.module and (
        node.module.split('.')[0] == 'tensorflow_federated'):
      tff_names.update(a.asname or a.name for a in node.names)
      for alias in node.names:
        module = f'{node.module}.{alias.name}'
        if PRIVATE_MODULE.match(node.module) or PRIVATE_MODULE.match(module):
          uses.append((node.lineno, module, 'import'))
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
        PRIVATE_MODULE.match(node.value)):
      uses.append((node.lineno, node.value, 'module path'))
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute):
      name, base = node.attr, node.value
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
          node.func.id in ACCESSORS and len(node.args) >= 2 and
          isinstance(node.args[1], ast.Constant) and
          isinstance(node.args[1].value, str)):
      name, base = node.args[1].value, node.args[0]
    else:
      continue
    if (not name.startswith('_') or name.startswith('__') or
        name in NAMEDTUPLE_METHODS or _root_name(base) in ('self', 'cls')):
      continue
    if _root_name(base) in tff_names or (
        name in tff_private and (path, name) not in NOT_TFF):
      uses.append((node.lineno, name, 'private attribute'))
  return uses


def test_tff_internals_are_used_only_in_tff_internals():
  tff_private = _tff_private_names()
  # The scan sees what it must: TFF's private names include those the
  # project uses through tff_internals.
  assert {'_GRPC_CHANNEL_OPTIONS', '_partition_value', '_keras_model',
          '_process'} <= tff_private
  found = {}
  for path in _sources():
    for line, name, what in _uses(path, tff_private):
      found.setdefault((path, name), []).append(f'{path}:{line}: {what} '
                                                f'{name}')
  outside = [where for key, places in found.items() if key not in PENDING
             for where in places]
  assert not outside, ('TFF internals outside tff_algos/tff_internals.py '
                       '(move them there):\n' + '\n'.join(outside))
  moved = [f'{path} {name}' for path, name in PENDING
           if (path, name) not in found]
  assert not moved, f'no longer used, remove from PENDING: {moved}'


def test_the_scan_finds_each_kind_of_use(tmp_path):
  sample = tmp_path / 'sample.py'
  sample.write_text(
      'import importlib\n'
      'import tensorflow_federated as tff\n'
      'from tensorflow_federated.python.core.impl import compiler\n'
      'import tensorflow_federated.proto.v0.computation_pb2\n'
      'importlib.import_module("tensorflow_federated.python.learning")\n'
      'x = tff.learning._private\n'
      'y = model._keras_model\n'
      'z = getattr(manager, "_process", None)\n'
      'ok = self._process, state._replace(a=1), thing._not_tff_at_all\n')
  uses = _uses('sample.py', {'_keras_model', '_process'}, str(tmp_path))
  assert sorted((line, name) for line, name, _ in uses) == [
      (3, 'tensorflow_federated.python.core.impl.compiler'),
      (4, 'tensorflow_federated.proto.v0.computation_pb2'),
      (5, 'tensorflow_federated.python.learning'),
      (6, '_private'), (7, '_keras_model'), (8, '_process')]

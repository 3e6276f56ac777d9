"""Citations resolve inside the repository (docs/references.md).

Code, docs and tests cite papers as `[Label] Alg. 1`, `[Label] Sec. 5.3`,
...; every label must be one of references.md's entries, each with its
authors, title and arXiv id, and nothing may cite documents a clone does not
have (a specification's section numbers, paper files by number).
"""

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCES = os.path.join(REPO, 'docs', 'references.md')
CITATION = re.compile(
    r'\[([A-Za-z]+)\] (?:Alg|Algs|Sec|App|eq|eqs|Table|Fig|Def|Thm)\b')
UNRESOLVABLE = re.compile(r'SPEC\s*§?\s*\d|papers/\d{3}')


def _sources():
  listed = subprocess.run(['git', 'ls-files', '*.py', '*.md', '*.sh'],
                          cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.split()
  for path in listed:
    full = os.path.join(REPO, path)
    if os.path.exists(full):
      with open(full, encoding='utf-8') as f:
        yield path, f.read()


def _entries():
  with open(REFERENCES, encoding='utf-8') as f:
    text = f.read()
  sections = re.split(r'^## \[([A-Za-z]+)\]\n', text, flags=re.M)[1:]
  return dict(zip(sections[::2], sections[1::2]))


def test_every_entry_names_its_paper():
  entries = _entries()
  assert len(entries) >= 7
  for label, body in entries.items():
    assert re.search(r'arXiv:\d{4}\.\d{4,5}', body), label
    assert re.search(r'\*[^*]+\.\*', body), f'{label}: no title'
    assert re.search(r'(19|20)\d\d', body), f'{label}: no year'


def test_every_citation_resolves_and_nothing_cites_outside_the_repository():
  labels = set(_entries())
  cited = set()
  for path, text in _sources():
    assert not UNRESOLVABLE.search(text), (
        path, UNRESOLVABLE.search(text).group(0))
    for label in set(CITATION.findall(text)) - {'Label'}:  # The pattern.
      assert label in labels, f'{path} cites [{label}]'
      cited.add(label)
  # The papers the algorithms follow are all cited somewhere.
  assert {'FedProx', 'MixedFL', 'SCAFFOLD', 'FedPVR', 'FedRes'} <= cited

"""The round benchmark as a binary: `python -m binaries.benchmark` runs
`benchmarks/rounds.py` with its flags (see its docstring and the README's
Benchmark section); its measurements run as processes of that module."""

from absl import flags

from binaries import app  # First: imports TensorFlow quietly.
from benchmarks import rounds

# --help lists the main module's flags: these are rounds'.
flags.adopt_module_key_flags(rounds)

if __name__ == '__main__':
  app.run(rounds.main)

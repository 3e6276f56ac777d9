"""The one exception type binaries turn into a single error line and exit 1."""


class UsageError(Exception):
  """Bad user input: unknown names, impossible values, missing/corrupt files.

  The message names the flag or file and what is allowed; binaries print it as
  one line (no traceback) and exit non-zero before writing anything.
  """

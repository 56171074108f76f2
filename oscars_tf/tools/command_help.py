"""--help and -h for the package's absl commands: a usage line, a short
description, and every flag with its default, by section.

absl's own --help lists only the "key flags" of __main__, which for a
console script is the entry-point wrapper (none), and for `python -m` the
module's flags without their sections. Imports no TensorFlow.
"""

import os
import sys

from absl import app
from absl import flags

HELP_ARGS = ("-h", "--help", "-?", "--helpshort")


def help_text(usage, description, sections, flag_values):
  """`usage`, `description`, then each (title, flag names) section."""
  lines = [f"usage: {usage}", "", description, ""]
  for title, names in sections:
    lines.append(f"{title}:")
    for name in names:
      flag = flag_values[name]
      dashes = f"--[no]{name}" if flag.boolean else f"--{name}"
      lines.append(flags.text_wrap(f"{dashes}: {flag.help}", indent="    ",
                                   firstline_indent="  "))
      syntax = flag.parser.syntactic_help
      lines.append(f"    (default: {flag.default_as_str}"
                   f"{'; ' + syntax if syntax else ''})")
    lines.append("")
  lines.append("absl's own flags (logging, --flagfile): --helpfull.")
  return "\n".join(lines)


def flags_parser(text):
  """absl's flag parsing, but a help flag prints `text()` and exits 0.
  Help flags after `--` belong to a command being launched."""
  def parse(argv):
    ours = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    if any(arg in HELP_ARGS for arg in ours):
      try:
        print(text(), flush=True)
      except BrokenPipeError:  # `... --help | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
      sys.exit(0)
    return app.parse_flags_with_usage(argv)
  return parse

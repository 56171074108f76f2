"""Started in every process the tests run (conftest puts this folder first
on PYTHONPATH): Keras and TensorFlow do not see the optional packages they
import only if present.

`import keras` pulls in scikit-learn (for keras.wrappers), SciPy, IPython and
matplotlib when they are installed: about 2 s of CPU in each of the
hundreds of worker processes the suite starts, on 2 cores. oscars_tf uses
none of them. Code that imports them itself (a tutorial reading
sklearn.datasets, a benchmark drawing with matplotlib) still gets them.
"""

import sys

HIDDEN = frozenset(("sklearn", "scipy", "IPython", "matplotlib"))
FROM_IMPORTERS = frozenset(("keras", "tensorflow", "tf_keras"))


def _importer(frame):
  """The module whose code runs the import (past importlib's own frames)."""
  while frame is not None:
    name = frame.f_globals.get("__name__", "")
    if not name.startswith(("importlib", "_frozen_importlib")):
      return name
    frame = frame.f_back
  return ""


class HideOptionalFromFrameworks:
  """A meta-path finder that answers "not installed" to the frameworks."""

  def find_spec(self, name, path=None, target=None):  # pylint: disable=unused-argument
    if name.partition(".")[0] not in HIDDEN:
      return None
    if _importer(sys._getframe(1)).partition(".")[0] in FROM_IMPORTERS:  # pylint: disable=protected-access
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return None  # anyone else: the normal finders


if not any(type(f).__name__ == "HideOptionalFromFrameworks"
           for f in sys.meta_path):  # once, whichever way it was loaded
  sys.meta_path.insert(0, HideOptionalFromFrameworks())

"""Macros shared by the BUILD files."""

def py_script_binaries(library, exclude = []):
    """One py_binary per *.py script of the package (less `exclude`), each
    depending on `library`, which holds all of them."""
    for src in native.glob(["*.py"], exclude = exclude):
        native.py_binary(
            name = src[:-len(".py")],
            srcs = [src],
            legacy_create_init = False,
            main = src,
            python_version = "PY3",
            srcs_version = "PY3",
            deps = [library],
        )

"""oscars_tf: adaptive local SGD for TensorFlow on clusters of uneven speed."""

import pathlib

import setuptools

README = pathlib.Path(__file__).resolve().parent / "README.md"

setuptools.setup(
    name="oscars_tf",
    version="0.1.0",
    description=("A tf.distribute strategy for local SGD with adaptive, "
                 "heterogeneity-aware model averaging."),
    long_description=README.read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["oscars_tf", "oscars_tf.*"]),
    # Measured on Python 3.11 with TensorFlow 2.21 (its oldest Python is
    # 3.10); the coordination service's imports cover TensorFlow 2.16 on.
    python_requires=">=3.10",
    install_requires=["tensorflow>=2.16", "numpy", "absl-py", "tensorboard"],
    extras_require={
        "examples": ["scikit-learn"],
        "benchmarks": ["scikit-learn", "matplotlib"],
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis",
                 "scikit-learn", "selenium", "matplotlib", "pandas",
                 # tf_keras is released per TensorFlow minor version (each
                 # requires its own); ruff's rules change with its minor.
                 "tf_keras<2.22", "ruff>=0.17,<0.18"],
    },
    package_data={"oscars_tf.observability.dashboard": ["static/*.js"]},
    entry_points={
        "console_scripts": ["oscars-launch=oscars_tf.cli.launch:run"],
        "tensorboard_plugins": [
            "oscars = oscars_tf.observability.dashboard.plugin:OscarsPlugin"],
    },
    license="Apache-2.0",
)

"""oscars_tf: adaptive local SGD for TensorFlow on clusters of uneven speed."""

import setuptools

setuptools.setup(
    name="oscars_tf",
    version="0.1.0",
    description=("A tf.distribute strategy for local SGD with adaptive, "
                 "heterogeneity-aware model averaging."),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["oscars_tf", "oscars_tf.*"]),
    python_requires=">=3.9",
    install_requires=["tensorflow>=2.16", "numpy", "absl-py", "tensorboard"],
    extras_require={
        "examples": ["scikit-learn"],
        "benchmarks": ["scikit-learn", "matplotlib"],
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis",
                 "scikit-learn", "selenium", "matplotlib", "pandas",
                 "tf_keras", "ruff"],
    },
    package_data={"oscars_tf.observability.dashboard": ["static/*.js"]},
    entry_points={
        "console_scripts": ["oscars-launch=oscars_tf.cli.launch:run"],
        "tensorboard_plugins": [
            "oscars = oscars_tf.observability.dashboard.plugin:OscarsPlugin"],
    },
    license="Apache-2.0",
)

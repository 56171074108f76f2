"""Command-line entry points: `oscars-launch` (launch.py), the coordinator
task (`python -m oscars_tf.cli.coordinator`) and the absl flags a training
binary defines (flags.py)."""

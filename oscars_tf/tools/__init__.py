"""Tools: start and watch worker processes, network emulation. No TensorFlow."""
